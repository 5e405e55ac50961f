"""Conformance to real Lightning code: upstream's own public-API tests and examples, ported by
the README's rename alone, run under Lightning and under zerotrain (bench/CONFORMANCE.md).

Nothing of Lightning's is copied into the project: every command takes the path of an upstream
checkout (``git archive <tag> tests/tests_pytorch examples/pytorch src/lightning/pytorch/demos``)
and writes the ported trees and the results under a scratch folder WORK.

    python3 bench/conformance.py prepare UPSTREAM WORK [--lib zerotrain]   # WORK/<lib>/tests
    python3 bench/conformance.py run WORK lightning [GROUP ...]            # WORK/results/<lib>/
    python3 bench/conformance.py run WORK zerotrain [GROUP ...]
    python3 bench/conformance.py report WORK          # WORK/summary.json, WORK/causes.md (ranked)
    python3 bench/conformance.py examples UPSTREAM WORK                    # WORK/examples.json

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
sys.path.insert(0, os.path.join(ROOT, "tests", "lightning_examples"))
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
            ok = [t for t in passed if mine["tests"].get(t, ("missing",))[0] == "pass"]
            for t in passed:
                if t in ok:
                    continue
                status, why = mine["tests"].get(t, ("missing", None))
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
                    cells.append(("same" if r["ok"] else "differs") + f" (max dloss {r['max_dloss']:.1e}, dweight {r['max_dweight']:.1e})")
            out.append(f"| {script} | {row['lightning']} | " + " | ".join(cells) + " |")
    with open(os.path.join(work, "tables.md"), "w") as f:
        f.write("\n".join(out) + "\n")


#: examples/pytorch/basics: what each needs here. Only a download is replaced (by random data of
#: the same shape, written where the download would have put it); the scripts run unchanged.
EXAMPLES = {
    "transformer.py": None,
    "autoencoder.py": "needs torchvision (transforms, save_image); no torchvision wheel imports with this torch",
    "backbone_image_classifier.py": "needs torchvision (transforms.ToTensor in its datamodule); none imports here",
    "profiler_example.py": "imports torchvision (CIFAR10, resnet) at the top; none imports here",
}
#: what the harness sets on every Trainer the script builds (both libraries): the processes, the
#: strategy and a short run (the scripts train 10-20 epochs; the first EXAMPLE_STEPS steps compare)
EXAMPLE_STEPS = 20


def _wikitext(path: str, tokens: int = 2_088_628, vocab: int = 33_278) -> None:
    """A stand-in for WikiText2's train.txt (the demo downloads it): seeded random words, about
    its size in tokens and vocabulary, in lines of ~57 words as the original."""
    import random
    rng = random.Random(0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        left = tokens
        while left > 0:
            n = min(left, rng.randint(40, 74))
            f.write(" " + " ".join(f"w{rng.randrange(vocab)}" for _ in range(n)) + " \n")
            left -= n + 1


def examples(upstream: str, work: str, strategies: list[str], reuse: bool = False) -> dict:
    src = os.path.join(upstream, "examples", "pytorch", "basics")
    base = os.path.join(work, "examples")
    data = os.path.join(base, "data", "wikitext-2.txt")
    if not os.path.exists(data):
        _wikitext(data)
    table = {}
    for script, why in EXAMPLES.items():
        if why:
            table[script] = {"runnable": why}
            continue
        with open(os.path.join(src, script)) as f:
            text = f.read()
        runs = {}
        for lib, strategy in [("lightning", "ddp")] + [("zerotrain", s) for s in strategies]:
            out = os.path.join(base, f"{script[:-3]}-{lib}-{strategy}")
            if lib == "lightning" and reuse and os.path.exists(os.path.join(out, "rank1.json")):
                runs[(lib, strategy)] = {"rc": 0, "error": None, "records": [
                    json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]}
                continue
            out = os.path.join(base, f"{script[:-3]}-{lib}-{strategy}")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            os.symlink(os.path.dirname(data), os.path.join(out, "data"))
            copy = os.path.join(out, script)
            with open(copy, "w") as f:
                f.write(port(text) if lib == "zerotrain" else text)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   os.path.abspath(__file__), "_example", lib, copy, strategy, work]
            start = time.time()
            proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
            recs = []
            for r in range(2):
                f = os.path.join(out, f"rank{r}.json")
                recs.append(json.load(open(f)) if os.path.exists(f) else None)
            runs[(lib, strategy)] = {"rc": proc.returncode, "records": recs, "s": time.time() - start,
                                     "error": None if proc.returncode == 0 else _last_error(proc.stderr + proc.stdout)}
            print(f"{script} {lib} {strategy}: rc {proc.returncode} ({time.time() - start:.0f} s)", flush=True)
        ref = runs[("lightning", "ddp")]
        row = {"lightning": "ok" if ref["rc"] == 0 else ref["error"],
               "stand_ins": sorted({n for r in runs.values() for rr in r["records"] if rr for n in rr.get("stand_ins", [])})}
        for s_ in strategies:
            mine = runs[("zerotrain", s_)]
            row[s_] = _compare(ref, mine)
        table[script] = row
    with open(os.path.join(work, "examples.json"), "w") as f:
        json.dump(table, f, indent=1)
    return table


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception)\b", ln.strip())
             and "torch.distributed.elastic" not in ln]
    return lines[-1][:300] if lines else text.strip().splitlines()[-1][:300] if text.strip() else "?"


def _compare(ref: dict, mine: dict) -> dict:
    if ref["rc"] or mine["rc"] or None in ref["records"] or None in mine["records"]:
        return {"ok": False, "error": mine["error"] or ref["error"] or "no record"}
    dloss = max(abs(a - b) for r in range(2) for a, b in
                zip(ref["records"][r]["losses"], mine["records"][r]["losses"], strict=True))
    p, q = ref["records"][0]["params"], mine["records"][0]["params"]
    if set(p) != set(q):
        return {"ok": False, "error": f"parameter names differ: {sorted(set(p) ^ set(q))[:4]}"}
    dw = max(max((abs(a - b) for a, b in zip(p[k], q[k], strict=True)), default=0.0) for k in p)
    dtest = max((abs(v - mine["records"][0]["test"].get(k, float("inf"))) for k, v in ref["records"][0]["test"].items()),
                default=0.0)
    first = {k: [ref["records"][r].get(k) == mine["records"][r].get(k) for r in range(2)]
             for k in ("initial_param_sum", "batch_sums", "rng")}
    return {"ok": max(dloss, dw, dtest) <= 1e-5, "steps": len(ref["records"][0]["losses"]), "same": first,
            "max_dloss": dloss, "max_dweight": dw, "max_dtest": dtest}


def _demo_stand_ins(work: str) -> list[str]:
    """Names the examples import from ``lightning.pytorch.demos`` that ``zerotrain.demos`` lacks
    get upstream's (ported) classes, so an example measures the Trainer; returned for the table."""
    import importlib.util
    demos = importlib.import_module("zerotrain.demos")
    path = os.path.join(work, "zerotrain", "tests", "_upstream_demos", "transformer.py")
    spec = importlib.util.spec_from_file_location("_upstream_demos_transformer", path)
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    missing = [n for n in ("Transformer", "WikiText2") if not hasattr(demos, n)]
    for name in missing:
        setattr(demos, name, getattr(theirs, name))
    return missing


def _example_rank(lib: str, script: str, strategy: str, work: str) -> None:
    """One rank of an example (under torchrun): the script runs as __main__, unchanged; every
    Trainer it builds gets the processes, the strategy, the short run and a recording callback."""
    import functools
    import runpy

    import torch
    torch.set_num_threads(1)
    rec = {"losses": [], "params": {}, "test": {}, "stand_ins": []}
    if lib == "zerotrain":
        sys.path.insert(0, os.path.join(work, "zerotrain", "tests"))
        exec(DEMOS_SHIM, {})
        import zerotrain as L
        Trainer = L.Trainer
        rec["stand_ins"] = _demo_stand_ins(work)
    else:
        import lightning.pytorch as L
        Trainer = L.Trainer

    class Record(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # to tell a different start from a different step
            rec["initial_param_sum"] = float(sum(p.detach().double().sum() for p in pl_module.parameters()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rec.setdefault("batch_sums", []).append(float(sum(t.double().sum() for t in batch)))
            rec.setdefault("rng", []).append(float(torch.rand(1, generator=torch.Generator().set_state(
                torch.get_rng_state()))))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            rec["losses"].append(float(loss))

        def on_fit_end(self, trainer, pl_module):
            state = trainer.full_state_dict() if lib == "zerotrain" else pl_module.state_dict()
            rec["params"] = {k: v.detach().double().flatten().tolist() for k, v in state.items()}

        def on_test_end(self, trainer, pl_module):
            rec["test"] = {k: float(v) for k, v in trainer.callback_metrics.items()}

    init = Trainer.__init__

    @functools.wraps(init)
    def patched(self, *args, **kwargs):
        callbacks = kwargs.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        kwargs.update(accelerator="cpu", devices=2, strategy=strategy, max_steps=EXAMPLE_STEPS,
                      limit_val_batches=2, limit_test_batches=2, enable_progress_bar=False,
                      callbacks=callbacks + [Record()])
        init(self, *args, **kwargs)

    Trainer.__init__ = patched
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    rank = int(os.environ.get("RANK", "0"))
    with open(f"rank{rank}.json", "w") as f:
        json.dump(rec, f)
    if lib == "lightning":  # see tests/lightning_examples/driver.py: Lightning's gloo teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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
    if len(sys.argv) > 1 and sys.argv[1] == "_example":  # one rank, started by `examples`
        _example_rank(*sys.argv[2:6])
        return
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.upstream, args.work, args.lib or ["lightning", "zerotrain"])
    elif args.cmd == "run":
        run(args.work, args.lib, args.groups or list(GROUPS), args.timeout, args.module)
    elif args.cmd == "examples":
        print(json.dumps(examples(args.upstream, args.work, args.strategy or ["ddp", "zero2", "zero3"],
                                     args.reuse_lightning), indent=1))
    else:
        s = report(args.work)
        print(json.dumps({g: {k: v for k, v in d.items() if k != "modules"} for g, d in s.items() if g != "causes"}))


if __name__ == "__main__":
    main()
