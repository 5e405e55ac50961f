"""ZeRO-3 pieces in one process (no process group): the unit plan, the optimizer runs, the options,
the parameter-touch mode, partitioned construction, a unit's state machine, and the strategy's
step against plain PyTorch."""
import pytest
import torch
from torch import nn

from tolerance import assert_no_worse_than_peer, assert_within_sum_bound, backward_as_ranks
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.strategies import strategy_from_name
from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.precision import Precision
from zerotrain.strategies.zero import Stage3Config, ZeroStage3
from zerotrain.strategies.zero.layout import build_layout
from zerotrain.strategies.zero.stage3.materialize import PartitionedBuild
from zerotrain.strategies.zero.stage3.touch import func_name, is_overwrite
from zerotrain.strategies.zero.stage3.unit import ShardState, Unit, is_placeholder
from zerotrain.strategies.zero.stage3.unit_plan import PERSISTENT, Run, make_policy, optimizer_runs, plan_units
from zerotrain.trainer.api.module import TrainModule

CFG = GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=8)


# ---------------------------------------------------------------------------- the plan
def test_default_plan_one_unit_per_block_root_for_the_rest():
    plan = plan_units(GPT(CFG), None, persistence_threshold=8)
    names = [u.name for u in plan.units]
    assert names == ["", "blocks.0", "blocks.1", PERSISTENT]
    root, b0 = plan.units[0], plan.units[1]
    assert root.params == ("wte.weight", "wpe.weight")  # lm_head.weight is wte.weight
    assert plan.aliases["lm_head.weight"] == "wte.weight"
    assert b0.params == ("blocks.0.attn.c_attn.weight", "blocks.0.attn.c_proj.weight",
                         "blocks.0.mlp.c_fc.weight", "blocks.0.mlp.c_proj.weight")
    assert "ln_f.weight" in plan.units[-1].params and "blocks.1.ln_2.weight" in plan.units[-1].params


class Shared(nn.Module):
    """A weight shared by two units, a unit nested in a unit, and an integer parameter."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4)])
        self.layers[1].weight = self.layers[0][0].weight
        self.count = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)


def test_a_parameter_used_by_two_units_goes_to_their_common_unit():
    plan = plan_units(Shared(), None)
    owner = plan.unit_of()
    assert owner["layers.0.0.weight"] == ""  # shared by layers.0 and layers.1: the root gathers it
    assert owner["layers.0.1.weight"] == "layers.0" and owner["layers.1.bias"] == "layers.1"
    assert plan.unmanaged == ("count",)
    nested = plan_units(Shared(), make_policy(["Sequential", "Linear"]))
    owner = nested.unit_of()
    assert owner["layers.0.0.bias"] == "layers.0.0"  # the innermost unit
    assert owner["layers.0.0.weight"] == ""  # layers.0.0 and layers.1: only the root encloses both
    by_callable = plan_units(Shared(), make_policy(lambda name, m: name == "layers.1"))
    assert [u.name for u in by_callable.units] == ["", "layers.1"]


def test_unit_modules_that_name_no_class_of_the_model_are_an_error(caplog):
    """A misspelt class list used to make the whole model one unit, gathered at once, silently."""
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match=r"unit_modules=\['Blok'\] names no module class of the model; its "
                                         r"module classes: .*Block"):
        plan_units(model, make_policy(["Blok"]))
    with caplog.at_level("WARNING", logger="zerotrain"):
        plan = plan_units(model, make_policy(["Block", "LlamaDecoderLayer"]))  # a list for several models
    assert len(plan.units) == 3 and "LlamaDecoderLayer, which no module of this model is" in caplog.text


@pytest.mark.parametrize("bad,err", [("Block", TypeError), ([], ValueError), ([3], TypeError), (",", ValueError)])
def test_unit_modules_must_be_class_names_or_a_callable(bad, err):
    if bad != ",":  # make_policy takes a list; the option also takes one comma-separated string
        with pytest.raises(err, match="unit_modules"):
            make_policy(bad)
    if bad != "Block":
        with pytest.raises(err, match="unit_modules"):
            ZeroStage3(unit_modules=bad)
    assert ZeroStage3(unit_modules="Block, MLP").stage3.unit_modules == ("Block", "MLP")


def test_optimizer_runs_cut_a_partition_by_param_group():
    layout = build_layout([5, 3, 4], world_size=2)  # padded to 12: rank 0 [0, 6), rank 1 [6, 12)
    assert optimizer_runs(layout, 0, [0, None, 1]) == [Run(0, 0, 5)]  # the frozen one is left out
    assert optimizer_runs(layout, 1, [0, None, 1]) == [Run(1, 2, 4)]
    assert optimizer_runs(layout, 0, [0, 0, 0]) == [Run(0, 0, 6)]  # adjacent runs merge
    assert optimizer_runs(layout, 1, [0, 1, 1]) == [Run(1, 0, 6)]


@pytest.mark.parametrize("kw,match", [
    ({"prefetch_bucket_size": -1}, "prefetch_bucket_size=-1"),
    ({"max_live_parameters": 0}, "max_live_parameters=0"),
    ({"param_persistence_threshold": 1.5}, "param_persistence_threshold=1.5"),
    ({"reshard_after_forward": "yes"}, "reshard_after_forward='yes'"),
    ({"max_reuse_distance": "all"}, "max_reuse_distance='all'; valid: 'auto' or a whole number"),
    ({"max_reuse_distance": -1}, "max_reuse_distance=-1"),
    ({"host_mmap_threshold": -1}, "host_mmap_threshold=-1"),
    ({"host_mmap_threshold": 64 << 20}, "host_mmap_threshold=67108864 exceeds glibc's limit; valid: 0"),
    ({"host_cache_min_bytes": -1}, "host_cache_min_bytes=-1"),
    ({"host_cache_slack_bytes": 1.5}, "host_cache_slack_bytes=1.5"),
])
def test_stage3_options_are_validated(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ZeroStage3(**kw)


def test_zero3_is_registered_and_configurable():
    s = strategy_from_name("zero3")
    assert isinstance(s, ZeroStage3) and s.stage3.prefetch_bucket_size == 10_000_000
    assert s.stage3.max_reuse_distance == "auto" and s.config.host_mmap_threshold == 8 << 20
    assert s.config.host_cache_min_bytes == 1 << 20 and s.config.host_cache_slack_bytes == 0
    assert Stage3Config(max_live_parameters=1e9).max_live_parameters == 10**9
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import zerotrain.train  # noqa: F401  (registers the schemas, the demo model's too)
    from zerotrain.trainer.command.config import build_strategy
    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "strategy=zero3", "strategy.prefetch_bucket_size=1000", "strategy.unit_modules=[Block]",
            "strategy.activation_checkpointing=true"])
    s = build_strategy(OmegaConf.to_object(cfg).strategy)
    assert isinstance(s, ZeroStage3) and s.stage3.unit_modules == ("Block",)
    assert s.stage3.prefetch_bucket_size == 1000 and s.stage3.activation_checkpointing


# ---------------------------------------------------------------------------- the touch mode
def test_func_names_and_overwrites():
    p = nn.Parameter(torch.zeros(2, 3))
    assert func_name(torch.Tensor.shape.__get__) == "shape"
    assert func_name(torch.Tensor.data.__get__) == "data"
    assert is_overwrite(nn.init.normal_, (), {"tensor": p}, p)  # nn.init passes it by keyword
    assert is_overwrite(torch.Tensor.fill_, (p, 0.0), {}, p)
    assert not is_overwrite(torch.Tensor.mul_, (p, 2.0), {}, p)


# ---------------------------------------------------------------------------- partitioned construction
class Custom(nn.Module):
    """Parameters with values at registration, and an in-place edit that reads them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3))
        self.lin = nn.Linear(3, 4)
        with torch.no_grad():
            self.w.mul_(2.0)
            self.lin.weight[0].copy_(self.w[0, :3] + 1)
        self.register_buffer("table", torch.arange(4.0))


def _built(factory):
    """(partitioned build on one process, eager build, each followed by a random draw)."""
    torch.manual_seed(3)
    eager = factory()
    after_eager = torch.rand(3)
    torch.manual_seed(3)
    with PartitionedBuild(rank=0, world_size=1) as build:
        model = factory()
    after = torch.rand(3)
    values = {}
    for name, p in model.named_parameters():
        assert is_placeholder(p.data), name  # nothing is held whole after construction
        out = torch.empty(p.numel())
        build.take(p, out)
        values[name] = out.view(p.shape)
    return model, eager, values, torch.equal(after, after_eager)


@pytest.mark.parametrize("factory", [lambda: GPT(CFG), Custom], ids=["gpt", "custom"])
def test_partitioned_construction_equals_the_eager_build(factory):
    model, eager, values, same_rng = _built(factory)
    assert same_rng
    for name, q in eager.named_parameters():
        assert torch.equal(values[name], q), name
    for (name, b), (_, q) in zip(model.named_buffers(), eager.named_buffers()):
        assert torch.equal(b, q), name
    if isinstance(model, GPT):
        assert model.lm_head.weight is model.wte.weight  # the tie survived


def test_partitioned_construction_of_a_hugging_face_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=31, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model, eager, values, same_rng = _built(lambda: transformers.GPT2LMHeadModel(config))
    assert same_rng and model.lm_head.weight is model.transformer.wte.weight
    for name, q in eager.named_parameters():
        assert torch.equal(values[name], q), name


def test_a_meta_parameter_in_configure_model_is_refused():
    with pytest.raises(ValueError, match="meta device"):
        with PartitionedBuild(rank=0, world_size=1):
            nn.Linear(2, 2, device="meta")


# ---------------------------------------------------------------------------- a unit
def test_unit_state_machine_frees_memory_and_keeps_saved_views_valid():
    torch.manual_seed(0)
    lin = nn.Linear(3, 4)
    want = {k: v.clone() for k, v in lin.state_dict().items()}
    params = [lin.weight, lin.bias]
    layout = build_layout([p.numel() for p in params], 1)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    unit = Unit(1, "lin", params, ["weight", "bias"], layout, 0, torch.float32, torch.float32,
                torch.device("cpu"))
    unit.load_full(flat)
    assert unit.state is ShardState.SHARDED and unit.full.untyped_storage().nbytes() == 0
    assert lin.weight.shape == (4, 3) and torch.isnan(lin.weight).all()  # a placeholder
    with pytest.raises(RuntimeError):
        lin.weight.data.add_(1)  # writing a placeholder fails loudly
    unit.unshard()
    assert unit.state is ShardState.UNSHARDED and torch.equal(lin.weight, want["weight"])
    x = torch.randn(2, 3, requires_grad=True)
    y = lin(x)  # saves a view of the weight
    unit.reshard()
    assert unit.full.untyped_storage().nbytes() == 0
    unit.unshard()  # gathered again: the saved view reads the values again
    y.sum().backward()
    # tolerance: two orders of one 4-term sum: 2 sum_rtol(4) x sum|terms|, element-wise
    assert_within_sum_bound(x.grad, want["weight"].sum(0).expand(2, 3), 4, want["weight"].abs().sum(0).expand(2, 3))
    assert unit.has_grads()


# ---------------------------------------------------------------------------- the strategy
class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.ModuleList(nn.Linear(5, 5) for _ in range(3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.net:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_one_process_matches_pytorch_and_hooks_are_removable():
    ref = Net()
    ref.configure_model()
    opt = ref.configure_optimizers()
    s = ZeroStage3(prefetch_bucket_size=30)
    s.connect(ProcessInfo(), torch.device("cpu"), Precision())
    s.setup_environment()
    model = Net()
    s.configure_model(model)
    s.setup_module(model)
    s.setup_optimizer(model.configure_optimizers())
    peer = Net()  # the peer: the same steps, each gradient summed as torch DDP would on 2 ranks
    peer.configure_model()
    peer_opt = peer.configure_optimizers()
    g = torch.Generator().manual_seed(1)
    norms = {"got": [], "ref": [], "peer": []}
    for _ in range(4):
        micro = []
        for _ in range(2):
            b = (torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g))
            micro.append(b)
            (ref.training_step(b, 0) / 2).backward()
            s.backward(s.training_step(b, 0) / 2)
        backward_as_ranks(peer.parameters(), micro, lambda b: peer.training_step(b, 0), 2)
        norms["ref"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        norms["peer"].append(torch.nn.utils.clip_grad_norm_(peer.parameters(), 0.1))
        norms["got"].append(s.clip_grad_norm_(0.1))
        for o in (opt, peer_opt):
            o.step()
            o.zero_grad()
        s.optimizer_step()
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(*(torch.stack(norms[k]) for k in ("got", "ref", "peer")), "norms")
    full = s.full_state_dict()
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(full, ref.state_dict(), peer.state_dict())
    assert all(u.state is ShardState.SHARDED for u in s.units if not u.persistent)
    s.teardown()  # the model still works after fit
    with torch.no_grad():
        assert torch.isfinite(s.model("training_step", b, 0))
    assert torch.isnan(model.net[1].weight).all()
    with s.gathered(model.net[1]):  # tolerance: exact: the values full_state_dict() returned above
        torch.testing.assert_close(model.net[1].weight, full["net.1.weight"], rtol=0, atol=0)
    assert torch.isnan(model.net[1].weight).all()
    s.remove_hooks()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_gathers_working_dtype_and_steps_fp32_masters(precision):
    from zerotrain.strategies.precision import precision_from_name
    plugin = precision_from_name(precision)
    s = ZeroStage3()
    s.connect(ProcessInfo(), torch.device("cpu"), plugin)
    model = Net()
    s.configure_model(model)
    s.setup_module(model)
    s.setup_optimizer(model.configure_optimizers())
    seen = []
    model.net[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    before = [u.master.clone() for u in s.units]
    b = (torch.randn(4, 5), torch.randn(4, 5))
    for _ in range(2):
        loss = s.training_step(b, 0)
        s.backward(loss)
        assert s.optimizer_step(1.0)
    assert seen == [plugin.param_dtype] * 2 and torch.isfinite(loss)
    assert all(u.master.dtype == torch.float32 for u in s.units)
    assert all(u.working.dtype == plugin.param_dtype for u in s.units if u.layout.numel)
    assert not all(torch.equal(a, u.master) for a, u in zip(before, s.units))


def test_work_without_communication_lands_at_once():
    """One rank: a reduction's handle is ``Done``, so the entry lands when pushed (its pooled
    buffer goes back before the next unit's reduction takes one); real work stays in flight,
    and a Done entry behind it waits its turn."""
    from zerotrain.strategies.zero.comm.collectives import Done
    from zerotrain.strategies.zero.comm.inflight import InFlight, InFlightQueue

    class Pending:
        def wait(self):
            return True

    q, landed = InFlightQueue(max_in_flight=4), []
    q.push(InFlight((Done(),), (), lambda: landed.append("a")))
    assert landed == ["a"] and len(q) == 0
    q.push(InFlight((Pending(),), (), lambda: landed.append("b")))
    q.push(InFlight((Done(),), (), lambda: landed.append("c")))
    assert landed == ["a"] and len(q) == 2  # order kept: c lands after b
    q.wait_all()
    assert landed == ["a", "b", "c"]


def test_auto_reuse_budget_is_a_quarter_of_the_free_memory_after_the_optimizer_state():
    auto = Stage3Config()
    # 10 GB free, 1e8 shard elements (Adam's 0.8 GB still to come): a quarter of 9.2 GB in fp32
    assert auto.reuse_budget(10 * 10**9, 10**8, 4) == int(9.2e9 * 0.25) // 4
    assert auto.reuse_budget(2 * 10**9, 10**8, 2) == int(1.2e9 * 0.25) // 2  # bf16 working weights
    assert auto.reuse_budget(10**13, 0, 4) == 10**9  # within max_live_parameters' default
    assert auto.reuse_budget(10**8, 10**8, 4) == 0  # the optimizer state alone fills the rank
    assert Stage3Config(max_live_parameters=1000).reuse_budget(10**12, 0, 4) == 1000
    assert Stage3Config(max_reuse_distance=7).reuse_budget(10**12, 0, 4) == 7  # given: as it is


def test_free_bytes_per_rank_shares_the_host_and_respects_rlimit_data():
    import resource
    from zerotrain.strategies.memory.host import free_bytes_per_rank

    one = free_bytes_per_rank(torch.device("cpu"), 1)
    two = free_bytes_per_rank(torch.device("cpu"), 2)
    assert one > 0 and abs(two - one / 2) < 0.2 * one  # MemAvailable moves a little in between
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (used + (64 << 20), hard))
    try:
        assert free_bytes_per_rank(torch.device("cpu"), 1) <= 64 << 20
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def test_host_mmap_threshold_is_applied_once_and_zero_leaves_glibc_alone(monkeypatch):
    import platform
    from zerotrain.strategies.memory import host as host_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    calls = []

    class Libc:
        @staticmethod
        def mallopt(param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: Libc)
    monkeypatch.setattr(host_memory, "_applied", None)
    assert not host_memory.set_mmap_threshold(0) and calls == []
    assert host_memory.set_mmap_threshold(8 << 20) and calls == [(-3, 8 << 20)]
    assert host_memory.set_mmap_threshold(8 << 20) and len(calls) == 1  # already set


# ---------------------------------------------------------------------------- expert parameters (issue 46)
def _mark(module: torch.nn.Module, group_name: str = "ep_size_2") -> torch.nn.Module:
    for p in module.parameters():
        p.allreduce, p.group_name = False, group_name
    return module


def test_expert_modules_are_units_of_their_own_kind():
    """The topmost all-expert module becomes a unit even where the policy would not cut there, and
    every unit has one kind; experts of ep_size_1 count as dense, and never go persistent."""
    from zerotrain.strategies.zero.stage3.unit_plan import plan_units

    block = torch.nn.Module()
    block.lin = torch.nn.Linear(4, 4)
    block.experts = _mark(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)))
    block.replicated = _mark(torch.nn.Linear(4, 4), "ep_size_1")
    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList([block])
    plan = plan_units(root, persistence_threshold=100)
    kinds = {u.name: (u.kind, u.params) for u in plan.units}
    assert kinds["blocks.0.experts"] == ("ep_size_2", ("blocks.0.experts.0.weight", "blocks.0.experts.0.bias",
                                                       "blocks.0.experts.1.weight", "blocks.0.experts.1.bias"))
    assert kinds["<persistent>"][0] is None and "blocks.0.replicated.weight" in kinds["<persistent>"][1]
    assert all(k is None for n, (k, _) in kinds.items() if n != "blocks.0.experts")


def test_a_unit_mixing_experts_and_dense_parameters_is_refused():
    from zerotrain.strategies.zero.stage3.unit_plan import plan_units

    mixed = torch.nn.Linear(4, 4)
    mixed.weight.allreduce, mixed.weight.group_name = False, "ep_size_2"  # the bias stays dense
    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList([mixed])
    with pytest.raises(ValueError, match=r"unit 'blocks.0' holds parameters of kinds .*dense and expert-parallel"):
        plan_units(root)
