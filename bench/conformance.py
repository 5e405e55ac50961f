"""Conformance to real Lightning code: upstream's own public-API tests and examples, ported by
the README's rename alone, run under Lightning and under zerotrain (bench/CONFORMANCE.md).

Nothing of Lightning's is copied into the project: every command takes the path of an upstream
checkout (``git archive <tag> tests/tests_pytorch examples/pytorch src/lightning/pytorch/demos``)
and writes the ported trees and the results under a scratch folder WORK.

    python3 bench/conformance.py prepare UPSTREAM WORK [--lib zerotrain]   # WORK/<lib>/tests
    python3 bench/conformance.py run WORK lightning [GROUP ...]            # WORK/results/<lib>/
    python3 bench/conformance.py run WORK zerotrain [GROUP ...]
    python3 bench/conformance.py report WORK          # WORK/summary.json, WORK/causes.md (ranked)
    python3 bench/conformance.py examples UPSTREAM WORK    # WORK/examples.json (conformance_examples.py)

The Lightning side runs the files unchanged (``lightning`` 2.6.x installed); the zerotrain side
runs them after ``RENAMES`` (tests/lightning_examples), the rule the README states. Two upstream
infrastructure files keep importing the real Lightning, since they only set up or probe the
process and test nothing: ``tests_pytorch/conftest.py`` (resets Lightning's globals, mocks its
device counts) and ``helpers/runif.py`` (skip conditions). ``zerotrain.demos`` is zerotrain's own;
where it is missing, upstream's demos ported by the rename stand in (WORK/zerotrain/tests/conftest.py).
Only tests that pass under Lightning count; ``report`` groups the others' zerotrain failures by
exception type and first message line, numbers and paths blanked."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "lightning_examples"), os.path.join(ROOT, "tests")]  # its tolerance
from test_lightning_examples import port  # noqa: E402  (the README's rule, one definition)

#: public-API test modules, by group (paths under tests/tests_pytorch). "public" is the set the
#: issue's >= 90% is about; the others are public API counted apart; OUT_OF_SCOPE is internals.
GROUPS = {
    "public": [
        "trainer/flags/test_barebones.py", "trainer/flags/test_check_val_every_n_epoch.py",
        "trainer/flags/test_env_vars.py", "trainer/flags/test_fast_dev_run.py",
        "trainer/flags/test_inference_mode.py", "trainer/flags/test_limit_batches.py",
        "trainer/flags/test_min_max_epochs.py", "trainer/flags/test_overfit_batches.py",
        "trainer/flags/test_val_check_interval.py",
        "trainer/logging_/test_distributed_logging.py", "trainer/logging_/test_eval_loop_logging.py",
        "trainer/logging_/test_loop_logging.py", "trainer/logging_/test_train_loop_logging.py",
        "models/test_hooks.py", "models/test_hparams.py", "models/test_restore.py", "models/test_cpu.py",
        "checkpointing/test_checkpoint_callback_frequency.py", "checkpointing/test_model_checkpoint.py",
        "checkpointing/test_trainer_checkpoint.py", "checkpointing/test_torch_saving.py",
        "callbacks/test_callbacks.py", "callbacks/test_callback_hook_outputs.py",
        "callbacks/test_early_stopping.py", "callbacks/test_lambda_function.py",
        "callbacks/test_lr_monitor.py", "callbacks/test_model_checkpoint_additional_cases.py",
        "callbacks/test_model_checkpoint_edge_cases.py", "callbacks/test_model_checkpoint_manual_opt.py",
        "callbacks/test_model_checkpoint_step_interval_val_metric.py", "callbacks/test_timer.py",
        "callbacks/test_model_summary.py", "callbacks/progress/test_tqdm_progress_bar.py",
        "core/test_datamodules.py", "core/test_lightning_module.py", "core/test_lightning_optimizer.py",
        "core/test_saving.py",
        "trainer/optimization/test_backward_calls.py", "trainer/optimization/test_manual_optimization.py",
        "trainer/optimization/test_multiple_optimizers.py", "trainer/optimization/test_optimizers.py",
        "loops/test_evaluation_loop_flow.py", "loops/test_training_loop_flow_dict.py",
        "loops/test_training_loop_flow_scalar.py", "loops/test_flow_warnings.py",
        "loops/test_training_loop.py", "loops/test_all.py",
        "loggers/test_all.py", "loggers/test_csv.py", "loggers/test_tensorboard.py", "loggers/test_logger.py",
        "trainer/properties/test_estimated_stepping_batches.py", "trainer/properties/test_get_model.py",
        "trainer/properties/test_log_dir.py", "trainer/properties/test_loggers.py",
        "trainer/test_trainer.py", "trainer/test_dataloaders.py", "trainer/test_states.py",
        "trainer/test_config_validator.py", "trainer/dynamic_args/test_multiple_eval_dataloaders.py",
    ],
    # callbacks zerotrain does not offer (README lists its callbacks); public API, counted apart
    "other_callbacks": [
        "callbacks/test_device_stats_monitor.py", "callbacks/test_finetuning_callback.py",
        "callbacks/test_gradient_accumulation_scheduler.py", "callbacks/test_prediction_writer.py",
        "callbacks/test_pruning.py", "callbacks/test_rich_model_summary.py", "callbacks/test_spike.py",
        "callbacks/test_stochastic_weight_avg.py", "callbacks/test_throughput_monitor.py",
        "callbacks/test_weight_averaging.py", "callbacks/progress/test_rich_progress_bar.py",
    ],
    # loggers for third-party services (mocked clients)
    "service_loggers": ["loggers/test_comet.py", "loggers/test_mlflow.py", "loggers/test_wandb.py",
                        "loggers/test_litlogger.py", "loggers/test_utilities.py"],
    "cli": ["test_cli.py"],  # LightningCLI: another issue
    "tuner": ["tuner/test_lr_finder.py", "tuner/test_scale_batch_size.py", "tuner/test_tuning.py"],
}
#: internals (loop, connector and result objects, accelerator/strategy/plugin classes, profilers,
#: utilities): counted by collection only
OUT_OF_SCOPE = [
    "accelerators", "plugins", "strategies", "profilers", "overrides", "serve", "deprecated_api",
    "graveyard", "demos", "utilities", "trainer/connectors", "trainer/logging_/test_logger_connector.py",
    "trainer/test_ddp_sigterm_handling.py", "core/test_results.py", "core/test_metric_result_integration.py",
    "loops/test_loops.py", "loops/test_loop_state_dict.py", "loops/test_progress.py", "loops/test_fetchers.py",
    "loops/test_training_epoch_loop.py", "loops/test_evaluation_loop.py", "loops/test_prediction_loop.py",
    "loops/test_double_iter_in_iterable_dataset.py", "loops/optimization", "checkpointing/test_legacy_checkpoints.py",
    "models/test_amp.py", "models/test_gpu.py", "models/test_tpu.py", "models/test_ddp_fork_amp.py",
    "models/test_onnx.py", "models/test_torchscript.py", "models/test_torch_tensorrt.py",
    "models/test_fabric_integration.py", "helpers",
]
#: upstream infrastructure that keeps the real library's imports in the zerotrain tree (docstring)
KEEP_UNPORTED = {"tests_pytorch/conftest.py", "tests_pytorch/helpers/runif.py"}

PYTEST_INI = """[pytest]
addopts = --strict-markers --disable-pytest-warnings --ignore=legacy/checkpoints
markers =
    cloud: cloud tests
filterwarnings =
    error::FutureWarning
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore::FutureWarning:onnxscript
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
xfail_strict = true
junit_duration_report = call
junit_family = xunit1
"""

DEMOS_SHIM = '''"""zerotrain side only: upstream's demo models, ported by the rename, answer for
zerotrain.demos while zerotrain has no demos package of its own (bench/conformance.py). Lazy: a
demo that fails to import fails the tests importing it, with its own error."""
import importlib, importlib.abc, importlib.util, sys


class _Demos(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "zerotrain.demos" or name.startswith("zerotrain.demos."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return importlib.import_module("_upstream_demos" + spec.name[len("zerotrain.demos"):])

    def exec_module(self, module):
        pass


try:
    _mine = importlib.util.find_spec("zerotrain.demos")
except ImportError:
    _mine = None
if _mine is None:
    sys.meta_path.insert(0, _Demos())
'''


#: our pytest plugin, written into each tree: every test's outcome goes to a JSON-lines file as it
#: happens, so a test that ends the pytest process (zerotrain's launcher re-runs sys.argv for
#: devices=2 and may os._exit the parent) loses only itself; ``run`` resumes after it.
PLUGIN = '''import json, os
_out = None


def pytest_configure(config):
    global _out
    path = os.environ.get("CONFORMANCE_JSONL")
    if path and "LOCAL_RANK" not in os.environ and "RANK" not in os.environ:  # not a re-run rank
        _out = open(path, "a", buffering=1)


def _cause(rep):
    crash = getattr(getattr(rep, "longrepr", None), "reprcrash", None)
    text = str(rep.longrepr) if rep.longrepr is not None else ""
    e_lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    typed = [ln for ln in e_lines if ln.split(":")[0].replace(".", "").isidentifier() and ":" in ln]
    if typed:
        return typed[0]
    if crash is not None:
        return crash.message.splitlines()[0] if crash.message else "?"
    return (e_lines or text.strip().splitlines()[-1:] or ["?"])[0]


def pytest_collection_modifyitems(config, items):
    # a rank that a multi-process Trainer started by re-running this pytest command runs only the
    # test that started it (as Lightning runs its own multi-process tests one by one)
    target = os.environ.get("CONFORMANCE_CURRENT_TEST")
    if target and ("RANK" in os.environ or "LOCAL_RANK" in os.environ):
        keep = [item for item in items if item.nodeid == target]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid != target])
        items[:] = keep


def pytest_ignore_collect(collection_path, config):
    target = os.environ.get("CONFORMANCE_CURRENT_TEST")
    if target and ("RANK" in os.environ or "LOCAL_RANK" in os.environ) and collection_path.suffix == ".py":
        if not str(collection_path).endswith(target.split("::")[0]):
            return True
    return None


def pytest_runtest_logstart(nodeid, location):
    if _out:
        os.environ["CONFORMANCE_CURRENT_TEST"] = nodeid
        _out.write(json.dumps({"start": nodeid}) + "\\n")


def pytest_runtest_logreport(report):
    if not _out:
        return
    rec = {"id": report.nodeid, "when": report.when, "outcome": report.outcome}
    if hasattr(report, "wasxfail"):
        rec["outcome"] = "xfail" if report.skipped else "failed"
    if report.failed:
        rec["cause"] = _cause(report)[:400]
    elif report.skipped:
        rec["cause"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    _out.write(json.dumps(rec) + "\\n")


def pytest_collectreport(report):
    if _out and report.failed:
        _out.write(json.dumps({"id": report.nodeid, "when": "collect", "outcome": "failed",
                               "cause": _cause(report)[:400]}) + "\\n")


def pytest_sessionfinish(session, exitstatus):
    if _out:
        _out.write(json.dumps({"finished": int(exitstatus)}) + "\\n")
'''


def prepare(upstream: str, work: str, libs: list[str]) -> None:
    """WORK/<lib>/tests: upstream's tests_pytorch (+ demos for zerotrain), ported for <lib>."""
    for lib in libs:
        dst = os.path.join(work, lib, "tests")
        shutil.rmtree(os.path.join(work, lib), ignore_errors=True)
        shutil.copytree(os.path.join(upstream, "tests", "tests_pytorch"), os.path.join(dst, "tests_pytorch"))
        with open(os.path.join(dst, "pytest.ini"), "w") as f:
            f.write(PYTEST_INI)
        with open(os.path.join(dst, "conformance_plugin.py"), "w") as f:
            f.write(PLUGIN)
        if lib == "lightning":
            continue
        shutil.copytree(os.path.join(upstream, "src", "lightning", "pytorch", "demos"), os.path.join(dst, "_upstream_demos"))
        with open(os.path.join(dst, "conftest.py"), "w") as f:
            f.write(DEMOS_SHIM)
        for base, _, files in os.walk(dst):
            for name in files:
                path = os.path.join(base, name)
                rel = os.path.relpath(path, dst)
                if not name.endswith(".py") or rel in KEEP_UNPORTED or rel in ("conftest.py", "conformance_plugin.py"):
                    continue
                with open(path) as f:
                    text = f.read()
                new = port(text)
                if rel.startswith("_upstream_demos"):  # the demos import each other by their own path
                    new = new.replace("zerotrain.demos", "_upstream_demos")
                if new != text:
                    with open(path, "w") as f:
                        f.write(new)


def _modules(groups: list[str]) -> list[str]:
    return [m for g in groups for m in GROUPS[g]]


def run(work: str, lib: str, groups: list[str], timeout: int, only: list[str] | None = None) -> None:
    """One pytest process per group (``--continue-on-collection-errors``: a module that does not
    import fails its own tests only), or per module with ``--module``; CPU only. Outcomes go to
    WORK/results/<lib>/<batch>.jsonl; when a test ends the process, it is recorded as failed and
    pytest starts again without it and without the tests already reported."""
    tests = os.path.join(work, lib, "tests")
    out = os.path.join(work, "results", lib)
    os.makedirs(out, exist_ok=True)
    batches = [(m.replace("/", "__"), [m]) for m in only] if only else [(g, GROUPS[g]) for g in groups]
    for name, mods in batches:
        jsonl = os.path.join(out, name + ".jsonl")
        if os.path.exists(jsonl):
            os.remove(jsonl)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": tests, "OMP_NUM_THREADS": "1",
               "PL_DISABLE_FORK": "1", "NO_COLOR": "1", "CONFORMANCE_JSONL": jsonl}
        start, attempts = time.time(), 0
        while True:
            attempts += 1
            done, started, finished = _read_jsonl(jsonl)
            skip = sorted(set(done) | set(started))
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conformance_plugin",
                   "--timeout", str(timeout), "--continue-on-collection-errors"]
            cmd += [f"--deselect={t}" for t in skip] + [os.path.join("tests_pytorch", m) for m in mods]
            try:
                proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=4 * 3600)
                rc, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", ""
            done, started, finished = _read_jsonl(jsonl)
            if finished or attempts > 50:
                break
            lost = started  # begun, never torn down
            with open(jsonl, "a") as f:
                for t in lost:  # the test during which the process ended
                    f.write(json.dumps({"id": t, "when": "call", "outcome": "failed",
                                        "cause": f"the test ended the pytest process (exit status {rc}; {tail[:200]})"}) + "\n")
            if not lost:
                break
        print(f"{lib} {name}: {len(done)} tests, {attempts} pytest runs ({time.time() - start:.0f} s)", flush=True)


def _read_jsonl(path: str) -> tuple[dict, list, bool]:
    """({test id: [reports]}, ids started and never torn down, session finished) from a plugin file."""
    done, started, finished = defaultdict(list), [], False
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "start" in rec:
                    started.append(rec["start"])
                elif "finished" in rec:
                    finished = True
                else:
                    done[rec["id"]].append(rec)
    complete = {t for t, reps in done.items() if any(r["when"] in ("teardown", "collect") for r in reps)}
    return done, [t for t in started if t not in complete], finished


def _results(work: str, lib: str) -> dict[str, dict]:
    """{module: {"tests": {test id: (status, cause)}, "error": module-level error or None}} from
    the plugin files of ``lib`` (older JUnit files, where no plugin file has the module)."""
    known = {m for ms in GROUPS.values() for m in ms}
    out: dict[str, dict] = {}
    folder = os.path.join(work, "results", lib)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        done, _, _ = _read_jsonl(os.path.join(folder, name))
        for nodeid, reps in done.items():
            mod, _, test = nodeid.partition("::")
            mod = mod[len("tests_pytorch/"):]
            if mod not in known:
                continue
            entry = out.setdefault(mod, {"tests": {}, "error": None})
            if not test:
                entry["error"] = reps[0].get("cause", "collection error")
                continue
            entry["tests"][test] = _status(reps)
    junit = _junit(work, lib)
    for mod, entry in junit.items():
        out.setdefault(mod, entry)
    return out


def _status(reps: list[dict]) -> tuple[str, str | None]:
    failed = [r for r in reps if r["outcome"] == "failed"]
    if failed:
        r = failed[0]
        call_ok = any(x["when"] == "call" and x["outcome"] == "passed" for x in reps)
        return "fail", ("teardown after a passed test: " if r["when"] == "teardown" and call_ok else "") + r.get("cause", "?")
    if any(r["outcome"] == "xfail" for r in reps):
        return "xfail", None
    if any(r["outcome"] == "skipped" for r in reps):
        return "skip", next((r.get("cause") for r in reps if r["outcome"] == "skipped"), "")
    return "pass", None


def _junit(work: str, lib: str) -> dict[str, dict]:
    """The same from JUnit files (WORK/junit/<lib>/*.xml, the first runs' format)."""
    dotted = {"tests_pytorch." + m[:-3].replace("/", "."): m for ms in GROUPS.values() for m in ms}
    out: dict[str, dict] = {}
    folder = os.path.join(work, "junit", lib)
    files = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".xml")),
                   key=os.path.getmtime) if os.path.isdir(folder) else []
    for xml in files:
        for case in ET.parse(xml).getroot().iter("testcase"):
            name, cls = case.get("name"), case.get("classname") or ""
            bad = [c for c in case if c.tag in ("failure", "error")]
            skip = [c for c in case if c.tag == "skipped"]
            if not cls:  # a collection error: the whole module
                if name in dotted:
                    out.setdefault(dotted[name], {"tests": {}, "error": None})["error"] = \
                        _cause(bad[0]) if bad else "collection error"
                continue
            key = next((d for d in dotted if cls == d or cls.startswith(d + ".")), None)
            if key is None:
                continue
            entry = out.setdefault(dotted[key], {"tests": {}, "error": None})
            test = cls[len(key) + 1:] + "::" + name if cls != key else name
            if bad:
                entry["tests"][test] = ("fail", _cause(bad[0]))
            elif skip:
                entry["tests"][test] = ("xfail" if skip[0].get("type") == "pytest.xfail" else "skip",
                                        skip[0].get("message", ""))
            else:
                entry["tests"].setdefault(test, ("pass", None))
    return out



def _cause(element) -> str:
    """The failure's exception type and the first line of its message."""
    msg = (element.get("message") or "").strip()
    text = element.text or ""
    # the last "E   Type: message" block of the traceback names the exception
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    first = next((ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Warning|Interrupt)\b", ln)), None)
    if first is None:
        first = msg.splitlines()[0] if msg else (lines[0] if lines else element.tag)
    if "Timeout" in msg:
        first = "Timeout (per-test limit)"
    return first[:300]


def _cluster(cause: str) -> str:
    """A cause with its run-specific parts (numbers, paths, addresses, reprs) blanked."""
    c = re.sub(r"0x[0-9a-f]+", "0x?", cause)
    c = re.sub(r"/tmp/[^\s'\"]+|/work/[^\s'\"]+|PosixPath\([^)]*\)", "<path>", c)
    c = re.sub(r"tensor\([^)]*\)", "tensor(?)", c)
    c = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", c)
    c = re.sub(r"assert .*", "assert ...", c) if c.startswith("AssertionError") else c
    return c[:200]


def report(work: str) -> dict:
    light, zt = _results(work, "lightning"), _results(work, "zerotrain")
    summary, causes = {}, defaultdict(list)
    for group, mods in GROUPS.items():
        g = {"modules": {}, "lightning_pass": 0, "zerotrain_pass": 0, "collected": 0}
        for mod in mods:
            if mod not in light:
                continue
            passed = [t for t, (s, _) in light[mod]["tests"].items() if s == "pass"]
            mine = zt.get(mod, {"tests": {}, "error": "not run"})
            # a test id holds the parameters' names, which the rename changes too ([LightningModule] ->
            # [TrainModule]): the ported id is the same test
            ours = lambda t: mine["tests"].get(t) or mine["tests"].get(port(t), ("missing", None))  # noqa: E731
            ok = [t for t in passed if ours(t)[0] == "pass"]
            for t in passed:
                if t in ok:
                    continue
                status, why = ours(t)
                if status == "missing" and mine["error"] == "not run":
                    why = "module not run under zerotrain yet"
                elif status == "missing":
                    why = (f"module does not import: {mine['error']}" if mine["error"]
                           else "no outcome reported (its pytest run did not reach it)")
                elif status in ("skip", "xfail"):
                    why = f"{'skipped' if status == 'skip' else 'xfailed'}: {why}"
                causes[_cluster(why or "?")].append((group, mod, t))
            g["modules"][mod] = {"collected": len(light[mod]["tests"]), "lightning_pass": len(passed),
                                 "zerotrain_pass": len(ok), "zerotrain_error": mine["error"]}
            g["lightning_pass"] += len(passed)
            g["zerotrain_pass"] += len(ok)
            g["collected"] += len(light[mod]["tests"])
        summary[group] = g
    ranked = sorted(causes.items(), key=lambda kv: -len(kv[1]))
    summary["causes"] = [{"cause": c, "tests": len(ts), "groups": sorted({g for g, _, _ in ts}),
                          "examples": [f"{m}::{t}" for _, m, t in ts[:3]]} for c, ts in ranked]
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [f"# zerotrain conformance: remaining failures, ranked ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             f"zerotrain HEAD {_head()}", ""]
    for group, g in summary.items():
        if group != "causes" and g["lightning_pass"]:
            pct = 100.0 * g["zerotrain_pass"] / g["lightning_pass"]
            lines.append(f"- {group}: {g['zerotrain_pass']}/{g['lightning_pass']} ({pct:.1f}%) of the tests passing under Lightning")
    lines.append("")
    for i, c in enumerate(summary["causes"], 1):
        lines.append(f"{i}. [{c['tests']} tests; {', '.join(c['groups'])}] `{c['cause']}`")
        lines.extend(f"   - {e}" for e in c["examples"])
    with open(os.path.join(work, "causes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _tables(work, summary)
    return summary


def _tables(work: str, summary: dict) -> None:
    """WORK/tables.md: the per-module and per-group counts and the examples, as Markdown."""
    out = ["| group | modules | tests collected (Lightning) | pass under Lightning | of those, pass under zerotrain | % |",
           "|---|---|---|---|---|---|"]
    for group, g in summary.items():
        if group == "causes":
            continue
        pct = f"{100.0 * g['zerotrain_pass'] / g['lightning_pass']:.1f}" if g["lightning_pass"] else "-"
        out.append(f"| {group} | {len(g['modules'])} | {g['collected']} | {g['lightning_pass']} | {g['zerotrain_pass']} | {pct} |")
    out += ["", "| module (tests/tests_pytorch/) | group | pass under Lightning | pass under zerotrain | module-level error under zerotrain |",
            "|---|---|---|---|---|"]
    for group, g in summary.items():
        if group == "causes":
            continue
        for mod, m in g["modules"].items():
            err = (m["zerotrain_error"] or "").replace("|", "\\|")[:120]
            out.append(f"| {mod} | {group} | {m['lightning_pass']} | {m['zerotrain_pass']} | {err} |")
    ex = os.path.join(work, "examples.json")
    if os.path.exists(ex):
        out += ["", "| script | Lightning (ddp) | zerotrain ddp | zero2 | zero3 |", "|---|---|---|---|---|"]
        for script, row in json.load(open(ex)).items():
            if "runnable" in row:
                out.append(f"| {script} | not run here: {row['runnable']} | | | |")
                continue
            cells = []
            for s_ in ("ddp", "zero2", "zero3"):
                r = row.get(s_)
                if r is None:
                    cells.append("not run")
                elif "error" in r:
                    cells.append("fails: " + r["error"][:100])
                else:
                    bound = f"; no worse than the peer: bound {r['peer_bound']:.1e}" if "peer_bound" in r else ""
                    cells.append(("same" if r["ok"] else "differs") + f" (max dloss {r['max_dloss']:.1e}, "
                                 f"dweight {r['max_dweight']:.1e}{bound})")
            peer = row.get("peer")
            ref = row["lightning"] + (f"; peer (another clip order) max dloss {peer['max_dloss']:.1e}, dweight "
                                      f"{peer['max_dweight']:.1e}" if peer and "error" not in peer else "")
            out.append(f"| {script} | {ref} | " + " | ".join(cells) + " |")
    with open(os.path.join(work, "tables.md"), "w") as f:
        f.write("\n".join(out) + "\n")


def _head() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("upstream")
    a.add_argument("work")
    a.add_argument("--lib", action="append", choices=["lightning", "zerotrain"], help="default both")
    a = sub.add_parser("run")
    a.add_argument("work")
    a.add_argument("lib", choices=["lightning", "zerotrain"])
    a.add_argument("groups", nargs="*", help=f"of {list(GROUPS)}; default all")
    a.add_argument("--module", action="append", help="only these module paths")
    a.add_argument("--timeout", type=int, default=120, help="per-test limit (s)")
    a = sub.add_parser("report")
    a.add_argument("work")
    a = sub.add_parser("examples")
    a.add_argument("upstream")
    a.add_argument("work")
    a.add_argument("--strategy", action="append", help="zerotrain strategies (default ddp, zero2, zero3)")
    a.add_argument("--reuse-lightning", action="store_true", help="keep Lightning's records from a previous run")
    a.add_argument("--script", action="append", help="only these scripts (their rows in WORK/examples.json are replaced)")
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.upstream, args.work, args.lib or ["lightning", "zerotrain"])
    elif args.cmd == "run":
        run(args.work, args.lib, args.groups or list(GROUPS), args.timeout, args.module)
    elif args.cmd == "examples":
        from conformance_examples import examples  # bench/ is sys.path[0] when run as a script
        print(json.dumps(examples(args.upstream, args.work, args.strategy or ["ddp", "zero2", "zero3"],
                                     args.reuse_lightning, args.script), indent=1))
    else:
        s = report(args.work)
        print(json.dumps({g: {k: v for k, v in d.items() if k != "modules"} for g, d in s.items() if g != "causes"}))


if __name__ == "__main__":
    main()
