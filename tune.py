"""``zerotrain-tune`` / ``python -m zerotrain.tune``: find the fastest configuration of the model a
``zerotrain-train`` command line names (the user's ``model._target_``, or the demo GPT) that fits a
rank's memory, and write it as a config ``zerotrain-train`` takes.

It takes ``zerotrain-train``'s command line (the same Hydra overrides) after its own options::

    zerotrain-tune --max-rss-gb 1.5 --out tune model=gpt_21m trainer.devices=2
    zerotrain-train --config-dir $PWD/tune +tuned=best          # train with the winner

It searches strategy, micro-batch size (accumulation adjusted so the global batch stays), bucket
sizes and, under zero3, activation checkpointing (``trainer/command/tune_search.py`` has the space); prunes what
the memory estimate says cannot fit each rank (``--max-rss-gb``, or the machine's memory shared by
its ranks; ``--margin`` on top of the estimate); then runs the rest as short ``zerotrain-train``
runs in subprocesses, round-robin, timing the steps after the warm-up ones from each run's own
ResourceMonitor (``callbacks.resources_json``), and recording each rank's peak RSS.

Output in ``--out``: ``tune_table.txt`` (the ranked table, also printed), ``tune_results.json``,
``tune_chart.png`` (step time against peak RSS, the winner ringed) and ``tuned/<name>.yaml``: a
config of the ``tuned`` group that selects the winner's config groups and sets every value, so
``zerotrain-train --config-dir <out> +tuned=<name>`` composes exactly the winner's config.

Like ``train.py`` it never imports ``examples/``: it builds the module the config's ``_target_``
names (``train.build_module``, on the meta device: no memory) and counts its parameters; a module's
``activation_bytes(micro_batch, checkpointing, precision)`` method, where it has one (the demo GPT's
does), is the activation estimate, else none is counted and the measured peak alone decides; its
``tokens_per_sample()`` makes the table's tokens/s (else samples/s). Bad input (an unknown
strategy, a nonsense cap, a bad override) ends the command with exit code 2 and one line before any
process starts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from typing import Any, Optional

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import train
from .trainer.command import tune_search as T
from .trainer.command.chart import Point, scatter_png
from .trainer.command.compose_check import check_compose
from .trainer.errors import ConfigError
from .trainer.command.hydra_target import is_target

GROUPS = ("strategy", "precision", "optimizer", "model", "data", "trainer", "callbacks")
#: what a rank holds besides this process's imports: the process group, the data, the loader,
#: the allocator's slack (measured: a 2-rank gpt_tiny run peaks about 0.1 GiB above an idle import)
RUNTIME_ALLOWANCE = 100 * 2**20
#: keys the search sets, so the command line's values of them are replaced (``strategy.*`` too)
_SEARCHED = ("strategy", "data.batch_size", "trainer.accumulate_grad_batches")


def _fail(message: str) -> None:
    print(f"zerotrain-tune: configuration error: {message}", file=sys.stderr)
    sys.exit(2)


def _one_line(exc: BaseException) -> str:
    """The error's first line, and its cause's (Hydra wraps the type error of a bad override)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text += f" ({str(cause).strip().splitlines()[0]})"
    return text


def _csv(kind: type):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {kind.__name__}s") from None
    return parse


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="zerotrain-tune", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", type=_csv(str), default=list(T.STRATEGIES),
                    help=f"comma-separated, from {','.join(T.STRATEGIES)} (default: all)")
    ap.add_argument("--micro-batches", type=_csv(int), default=None,
                    help="micro-batch sizes per rank, each dividing data.batch_size x accumulation "
                         "(default: that number and its half)")
    ap.add_argument("--bucket-scales", type=_csv(float), default=[1.0, 0.25],
                    help="bucket sizes as multiples of each strategy's default (default: 1,0.25)")
    ap.add_argument("--no-checkpointing", action="store_true", help="leave activation checkpointing out")
    ap.add_argument("--max-rss-gb", type=float, default=None,
                    help="peak RSS cap per rank, GiB (default: the machine's memory / ranks per node)")
    ap.add_argument("--margin", type=float, default=0.1, help="safety margin on the estimate (default 0.1)")
    ap.add_argument("--base-rss-gb", type=float, default=None,
                    help="a rank's RSS before its model (default: this process's after importing torch, "
                         f"+{RUNTIME_ALLOWANCE / 2**20:.0f} MiB)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved (default 2)")
    ap.add_argument("--keep-within", type=float, default=0.15,
                    help="after round 1 only configurations this much slower than the fastest go on "
                         "(default 0.15; inf: all)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per run (default 600)")
    ap.add_argument("--out", default="tune", help="output directory (default ./tune)")
    ap.add_argument("--name", default="best", help="the tuned config's name: +tuned=NAME (default best)")
    ap.add_argument("--dry-run", action="store_true", help="print the space and the pruning; run nothing")
    ap.add_argument("--config-dir", "-cd", default=None,
                    help="a config folder of the user's own (its model/, data/, ... groups beside ours), "
                         "as zerotrain-train --config-dir takes it")
    ap.add_argument("overrides", nargs="*", help="zerotrain-train's Hydra overrides")
    return ap.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    """Every option's range, before anything is composed or started. Raises TuneError."""
    if a.config_dir is not None and not os.path.isdir(a.config_dir):
        raise T.TuneError(f"--config-dir={a.config_dir!r}: is not a directory; valid: a folder of config groups "
                          "(model/, data/, ...)")
    T.check_strategies(a.strategies)
    if a.max_rss_gb is not None:
        T.check_cap(a.max_rss_gb)
    T.check_margin(a.margin)
    if a.base_rss_gb is not None and not 0 <= a.base_rss_gb < 1e6:
        raise T.TuneError(f"--base-rss-gb={a.base_rss_gb!r}: must be a number of GiB >= 0; valid: e.g. 0.4")
    if not a.bucket_scales or any(not 0 < s < 1e6 for s in a.bucket_scales):
        raise T.TuneError(f"--bucket-scales={a.bucket_scales!r}: each must be > 0; valid: e.g. 1,0.25")
    for name, least in (("steps", 1), ("warmup_steps", 0), ("repeats", 1)):
        if getattr(a, name) < least:
            raise T.TuneError(f"--{name.replace('_', '-')}={getattr(a, name)!r}: must be >= {least}; "
                              f"valid: {least}, {least + 1}, ...")
    if not a.keep_within >= 0:
        raise T.TuneError(f"--keep-within={a.keep_within!r}: must be >= 0; valid: e.g. 0.15, or inf")
    if not a.timeout_s > 0:
        raise T.TuneError(f"--timeout-s={a.timeout_s!r}: must be > 0; valid: e.g. 600")
    if not a.name or any(c in a.name for c in "/\\= ,") or a.name.startswith("."):
        raise T.TuneError(f"--name={a.name!r}: must be a plain file name; valid: e.g. best, gpt21m_2ranks")
    bad = [o for o in a.overrides if o.startswith("-")]
    if bad:
        raise T.TuneError(f"{bad[0]}: not an option of zerotrain-tune; valid: see zerotrain-tune --help")


# ---------------------------------------------------------------------- composition
def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def is_searched(override: str) -> bool:
    """Set by the search (or by each run): the command line's value is replaced; the search path
    (``--config-dir``) is kept."""
    k = _key(override)
    return k in _SEARCHED or (k.startswith(("strategy.", "hydra.", "hydra/")) and k != "hydra.searchpath")


def compose(overrides: list[str], hydra: bool = False):
    """``zerotrain-train``'s composition of ``overrides`` (inside :func:`hydra_context`, or alone)."""
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=hydra)
    with hydra_context():
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def hydra_context():
    """Hydra initialised on ``zerotrain.conf`` once for many compositions."""
    from hydra import initialize_config_module

    return initialize_config_module(config_module="zerotrain.conf", version_base="1.3")


def checked_config(overrides: list[str]):
    """The composed, validated Config (as ``zerotrain-train`` checks it before starting a rank)."""
    return train.checked_config(compose(overrides))


def tuned_config(overrides: list[str], header: str) -> str:
    """The ``tuned/<name>.yaml`` text for this command line: its group choices and all values."""
    choices = compose(overrides, hydra=True).hydra.runtime.choices
    values = OmegaConf.to_container(compose(overrides), resolve=True)
    return T.tuned_yaml({g: str(choices[g]) for g in GROUPS}, values, header)


def run_overrides(run_dir: str, steps: int) -> list[str]:
    """A short timing run: no validation, checkpoints, TensorBoard, sample or progress bar; the
    ResourceMonitor writes every rank's steps to ``run_dir/resources.json``."""
    return [f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false", "callbacks.tensorboard=false", "callbacks.resources=true",
            "callbacks.flops_profile_step=null", f"callbacks.resources_json={run_dir}/resources.json",
            "sample_tokens=0", f"hydra.run.dir={run_dir}"]


def _own_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def machine_memory() -> int:
    """The memory this job may use: the cgroup's limit when one is set, else MemTotal."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def batch_size(cfg) -> int:
    """``data.batch_size``, the key the search sets, of the demo's data or of a ``data._target_``
    (where the section leaves it out: the default of the target's ``batch_size`` argument)."""
    data = cfg.data
    value = getattr(data, "batch_size", None)
    if is_target(data):
        value = data["batch_size"] if "batch_size" in data else _default_argument(data["_target_"], "batch_size")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise T.TuneError(f"data.batch_size={value!r}: zerotrain-tune varies the micro-batch through it; "
                          "valid: a positive int, e.g. data.batch_size=8 (an argument of the DataModule)")
    return value


def _default_argument(target: str, name: str) -> Any:
    import inspect

    from hydra.utils import get_object

    try:
        default = inspect.signature(get_object(target)).parameters[name].default
    except (KeyError, TypeError, ValueError):
        return None
    return None if default is inspect.Parameter.empty else default


class ModuleFacts:
    """What the estimate needs from the module the config names, built as ``zerotrain-train`` builds
    it (``train.build_module``) but on the meta device, ``configure_model`` included: its parameter
    count, its ``activation_bytes`` hook and its ``tokens_per_sample``."""

    def __init__(self, cfg) -> None:
        import torch

        try:
            with torch.device("meta"):
                module = self._built(cfg)
        except Exception:  # a module that cannot be built on the meta device: on the CPU, once
            module = self._built(cfg)
        self.name = type(module).__qualname__
        self.num_params = sum(p.numel() for p in module.parameters())  # a shared Parameter once
        hook = getattr(module, "activation_bytes", None)
        self.estimates_activations = callable(hook)
        precision = cfg.precision.name
        self.activation_bytes = ((lambda m, ck: int(hook(m, ck, precision))) if callable(hook)
                                 else (lambda m, ck: 0))
        tokens = getattr(module, "tokens_per_sample", None)
        tokens = tokens() if callable(tokens) else None  # TrainModule's default: None
        self.tokens_per_sample = int(tokens) if tokens else 1

    @staticmethod
    def _built(cfg):
        module = train.build_module(cfg)
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()
        return module


# ---------------------------------------------------------------------- the command
class Plan:
    """The composed base, the space, the estimates and the pruning: everything before a run."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.args = a
        overrides = train.hydra_overrides(a.overrides)
        self.base = checked_config(overrides)  # the whole command line, strategy options included
        self.kept_overrides = [o for o in overrides if not is_searched(o)]
        if self.base.trainer.num_nodes != 1:
            raise T.TuneError(f"trainer.num_nodes={self.base.trainer.num_nodes!r}: zerotrain-tune runs its trials "
                              "on this machine; valid: 1 (tune on one node, then train with the winner on more)")
        self.world = self.base.trainer.devices
        self.per_rank = batch_size(self.base) * self.base.trainer.accumulate_grad_batches
        self.module = ModuleFacts(self.base)
        self.tokens_per_step = self.per_rank * self.world * self.module.tokens_per_sample
        micro = T.micro_batch_choices(self.per_rank, a.micro_batches)
        self.space = T.search_space(a.strategies, self.per_rank, micro, a.bucket_scales, not a.no_checkpointing)
        self.cap, self.cap_source = self._cap()
        self.memory = self._memory()
        self.results = self._prune()
        self.default = self._default()

    def _cap(self) -> tuple[float, str]:
        """``--max-rss-gb``, never more than the machine's memory shared by the local ranks."""
        devices, gb = self.base.trainer.devices, self.args.max_rss_gb
        share = machine_memory() / devices
        if gb is not None and gb * T.GiB <= share:
            return gb * T.GiB, "--max-rss-gb"
        return share, f"machine memory / {devices} ranks per node"

    def _memory(self) -> T.MemoryModel:
        """The module's numbers for the estimate (:class:`ModuleFacts`)."""
        a = self.args
        base = a.base_rss_gb * T.GiB if a.base_rss_gb is not None else _own_rss() + RUNTIME_ALLOWANCE
        return T.MemoryModel(self.module.num_params, self.world, self.base.precision.name, int(base),
                             self.module.activation_bytes)

    def trial_overrides(self, c: T.Candidate) -> list[str]:
        """The command line of configuration ``c``: the kept overrides and the search's values
        (``data.batch_size`` becomes a ``++`` key of a ``data._target_``, as on the command line)."""
        return train.hydra_overrides(self.kept_overrides + c.overrides())

    def _prune(self) -> list[T.Result]:
        """Every configuration with its estimate; the pruned ones say why. The kept ones are
        checked as zerotrain-train checks its config, now rather than in a subprocess."""
        kept, pruned = T.prune(self.space, self.memory, self.cap, self.args.margin)
        results = [T.Result(c, T.estimate(c, self.memory)) for c in self.space]
        for r in results:
            if r.candidate in pruned:
                r.status, r.why = "pruned", pruned[r.candidate]
        for c in kept:
            checked_config(self.trial_overrides(c))
        return results

    def _default(self) -> Optional[T.Candidate]:
        """The command line's own configuration, when the space holds it."""
        s = self.base.strategy
        if s.name not in T.STRATEGIES:
            return None
        c = T.Candidate(s.name, batch_size(self.base), self.base.trainer.accumulate_grad_batches,
                        getattr(s, T.BUCKET_FIELDS[s.name][0]), bool(getattr(s, "activation_checkpointing", False)))
        return c if c in self.space else None

    def describe(self) -> str:
        m, a = self.memory, self.args
        pruned = sum(r.status == "pruned" for r in self.results)
        return (f"zerotrain-tune: {len(self.space)} configurations ({', '.join(a.strategies)}; global batch "
                f"{self.per_rank * self.world} = {self.per_rank}/rank x {self.world} ranks), {pruned} pruned; "
                f"cap {self.cap / T.GiB:.3f} GiB per rank ({self.cap_source}), margin {a.margin:.0%}; "
                f"estimate = base {m.base_bytes / T.GiB:.3f} GiB + model states ({self.module.name}: "
                f"{m.num_params:,} params, {m.precision}) + max(activations + in-flight gradients/parameters, "
                "optimizer step temporaries)" + ("" if self.module.estimates_activations else
                f"; activations not estimated ({self.module.name} has no activation_bytes method): the "
                "measured peak RSS decides"))


def _runner(plan: Plan, out: str):
    a, n = plan.args, {}

    def run(c: T.Candidate, rnd: int) -> T.Measurement:
        index = n.setdefault(c, len(n))
        run_dir = os.path.join(out, "runs", f"{index:02d}-{c.label.replace(' ', '_')}", f"r{rnd}")
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)
        cmd = [sys.executable, "-m", "zerotrain.train", *plan.trial_overrides(c),
               *run_overrides(run_dir, a.warmup_steps + a.steps)]
        return T.run_config(cmd, run_dir, a.warmup_steps, a.timeout_s)
    return run


def _chart(path: str, ranked: list[T.Result], best: Optional[T.Result], cap: float) -> str:
    points = [Point(max(r.peak_rss) / T.GiB, r.step_s * 1e3, r.candidate.label, r is best)
              for r in ranked if r.runs]
    near = points and cap / T.GiB <= 1.5 * max(p.x for p in points)  # a far cap would squash the points
    return scatter_png(path, points, "peak RSS per rank (GiB, max over ranks)", "step time (ms)",
                       "zerotrain-tune: step time vs memory", x_line=cap / T.GiB if near else None)


def report(plan: Plan, out: str, elapsed: float) -> Optional[T.Result]:
    """The table, the chart, the results and the tuned config; returns the winner."""
    ranked = T.rank(plan.results)
    best = T.winner(ranked)
    table = T.format_table(ranked, plan.tokens_per_step, plan.default)
    with open(os.path.join(out, "tune_table.txt"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)
    renderer = _chart(os.path.join(out, "tune_chart.png"), ranked, best, plan.cap)
    T.write_results(os.path.join(out, "tune_results.json"), ranked, {
        "cap_bytes": plan.cap, "margin": plan.args.margin, "base_bytes": plan.memory.base_bytes, "tokens_per_step": plan.tokens_per_step,
        "winner": best.candidate.label if best else None,
        "default": plan.default.label if plan.default else None, "elapsed_s": elapsed,
        "overrides": plan.kept_overrides})
    print(f"chart: {out}/tune_chart.png ({renderer}); results: {out}/tune_results.json")
    if best is not None:
        path = os.path.join(out, "tuned", f"{plan.args.name}.yaml")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        header = (f"zerotrain-tune's winner: {best.candidate.label}, {best.step_s * 1e3:.1f} ms/step, peak RSS "
                  f"{max(best.peak_rss) / T.GiB:.3f} GiB per rank\n"
                  f"use: {train_command(plan.args, out)}")
        with open(path, "w") as f:
            f.write(tuned_config(plan.trial_overrides(best.candidate), header))
        print(f"winner: {best.candidate.label}; config: {path}\n"
              f"train with it: {train_command(plan.args, out)}")
    return best


def with_config_dir(config_dir: Optional[str], overrides: list[str]) -> list[str]:
    """``--config-dir DIR`` as the override every composition and every trial run takes: Hydra's
    search path with ``DIR`` on it (zerotrain-train's ``--config-dir`` puts it there too)."""
    if config_dir is None:
        return overrides
    return [f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]", *overrides]


def train_command(a: argparse.Namespace, out: str) -> str:
    """The ``zerotrain-train`` command line that trains the winner (the user's config folder too)."""
    own = f" 'hydra.searchpath=[file://{os.path.abspath(a.config_dir)}]'" if a.config_dir else ""
    return f"zerotrain-train --config-dir {os.path.abspath(out)}{own} +tuned={a.name}"


def main(argv: Optional[list[str]] = None) -> int:
    from tqdm import tqdm

    a = parse_args(argv)
    try:
        check_args(a)
        a.overrides = with_config_dir(a.config_dir, a.overrides)
        check_compose(train.hydra_overrides(a.overrides), "zerotrain.conf", "config")  # as zerotrain-train
        with hydra_context():
            plan = Plan(a)
    except (T.TuneError, ConfigError, ValueError, OmegaConfBaseException, HydraException) as exc:
        _fail(_one_line(exc))
    print(plan.describe(), flush=True)
    todo = sum(r.status == "pending" for r in plan.results)
    if a.dry_run or not todo:
        print(T.format_table(T.rank(plan.results), plan.tokens_per_step, plan.default))
        if not todo:
            print("zerotrain-tune: every configuration was pruned: raise --max-rss-gb or shrink the model",
                  file=sys.stderr)
        return 0 if a.dry_run else 1
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C: subprocess.run then kills the run in progress (its other ranks
    # die with it), so stopping the tuner leaves no training behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = time.monotonic()
    with tqdm(total=todo * a.repeats, desc="zerotrain-tune", unit="run", file=sys.stderr) as bar:
        T.measure(plan.results, _runner(plan, out), a.repeats, a.keep_within, bar)
    T.apply_cap(plan.results, plan.cap)
    with hydra_context():
        best = report(plan, out, time.monotonic() - start)
    if best is None:
        print("zerotrain-tune: no configuration ran within the cap (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
