"""A tensor-parallel plan found by name and shape, for a model that declares no ``tp_plan``
(GPT-2; DeepSpeed 0.19.8's AutoTP refuses GPT-2 in training: its heuristic parser lists it as
unsupported, see bench/CONFORMANCE.md).

The rule, with ``H`` the model's hidden size (``config.hidden_size``) and ``tp`` the tensor ranks:

* the blocks are the children of every ``nn.ModuleList`` (a decoder's layers); their projections are
  their ``nn.Linear`` and Hugging Face ``Conv1D`` submodules (``tensor_conv1d``), taken in groups by
  the module that holds them (the attention, the MLP);
* in a group of two or more, the last-registered projection that writes ``H`` features (back to the
  residual stream: ``c_proj``, ``o_proj``, ``down_proj``, ``dense``) is row-parallel, and every
  other one, which must read ``H``, column-parallel;
* a column projection named as a fused ``[q | k | v]`` (``c_attn``, ``qkv_proj``, ``Wqkv``,
  ``W_pack``) is three blocks, each split by head groups (rank r: heads ``[r H/tp, (r+1) H/tp)`` of q,
  of k and of v); it must write 3 x the row projection's input (equal q, k, v: no GQA); a fused
  ``gate_up_proj`` is two blocks;
* the group's module then describes its local shard: its integer ``split_size``, ``num_heads``,
  ``num_attention_heads``, ``num_key_value_heads``, ``num_kv_heads``, ``embed_dim`` and
  ``all_head_size`` are divided by ``tp`` (GPT-2's attention splits q, k, v by ``split_size``);
* a group whose widths or head counts do not divide by ``tp``, whose shapes fit none of the above, or
  with a fused ``query_key_value`` (per head interleaved in GPT-NeoX and Bloom, in blocks elsewhere:
  name and shape do not tell) stays whole on every rank, with a warning; so do the embeddings, the
  norms and the LM head (a tied head and embedding stay tied).

Refused: a model with no hidden size, or in which the rule cuts nothing.
"""
from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn

from .tensor_conv1d import is_conv1d, linear_features
from .tensor_plan import parallelize_tensor

#: fused projections by name -> their packed blocks along the output
FUSED = {"c_attn": 3, "qkv_proj": 3, "Wqkv": 3, "W_pack": 3, "gate_up_proj": 2}
#: a fused projection whose layout name and shape do not tell
AMBIGUOUS = ("query_key_value",)
#: the attributes of a cut group's module that count its heads or its projections' widths
LOCAL_ATTRS = ("split_size", "num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "embed_dim",
               "all_head_size")


def hidden_size(model: nn.Module) -> int:
    for module in model.modules():
        size = getattr(getattr(module, "config", None), "hidden_size", None)
        if isinstance(size, int):
            return size
    raise ValueError(f"tensor plan by shape: {type(model).__name__} has no config.hidden_size; valid: a Hugging Face "
                     f"model (or a tp_plan)")


def _projection_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """``{holder path: [(projection path, module), ...]}`` inside the children of every ModuleList."""
    found: dict[str, nn.Module] = {}
    for list_name, modules in model.named_modules():
        if isinstance(modules, nn.ModuleList):
            for block_name, block in modules.named_children():
                prefix = f"{list_name}.{block_name}" if list_name else block_name
                found.update((n, m) for n, m in block.named_modules(prefix=prefix)
                             if isinstance(m, nn.Linear) or is_conv1d(m))
    groups: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in found.items():
        groups.setdefault(name.rpartition(".")[0], []).append((name, module))
    return groups


def _cut_group(holder: nn.Module, group: list[tuple[str, nn.Module]], hidden: int, heads: int | None,
               tp: int) -> tuple[dict, dict] | str:
    """``(plan entries, attributes)`` of one group, or why it stays whole."""
    shapes = {name: linear_features(m) for name, m in group}
    writers = [name for name in shapes if shapes[name][1] == hidden]
    if len(group) < 2 or not writers:
        return "no row projection (one writing the hidden size) beside a column one"
    row = writers[-1]
    inner = shapes[row][0]
    plan: dict = {row: "rowwise"}
    fused = False
    for name, (fan_in, fan_out) in shapes.items():
        if name == row:
            continue
        short = name.rpartition(".")[2]
        if fan_in != hidden:
            return f"{short} reads {fan_in} features, not the hidden size {hidden}"
        if short in AMBIGUOUS:
            return f"{short}: a fused projection whose layout (per head or in blocks) name and shape do not tell"
        chunks = FUSED.get(short, 1)
        if chunks == 3 and fan_out != 3 * inner:
            return f"{short} writes {fan_out}, not 3 x {inner} (equal q, k, v blocks)"
        if fan_out % (chunks * tp):
            return f"{short} writes {fan_out} features, which do not divide into {chunks} block(s) x {tp} ranks"
        fused |= chunks == 3
        plan[name] = ("colwise", chunks) if chunks > 1 else "colwise"
    if inner % tp:
        return f"{row.rpartition('.')[2]} reads {inner} features, which do not divide into {tp} ranks"
    attrs = {a: getattr(holder, a) for a in LOCAL_ATTRS
             if isinstance(getattr(holder, a, None), int) and not isinstance(getattr(holder, a), bool)}
    if fused and heads is not None and heads % tp:
        return f"{heads} attention heads do not divide into {tp} ranks"
    bad = [f"{a}={v}" for a, v in attrs.items() if v % tp]
    if bad:
        return f"{', '.join(bad)}: not divisible into {tp} ranks"
    return plan, {a: v // tp for a, v in attrs.items()}


def plan_by_shape(model: nn.Module, tp: int) -> tuple[dict, dict, dict]:
    """``(plan, attributes, whole)`` for ``tp`` tensor ranks by the module's rule: the plan for
    ``parallelize_tensor``, ``{holder path: {attribute: local value}}`` to set after the cut, and
    ``{holder path: why it stays whole}``. Nothing is changed."""
    hidden = hidden_size(model)
    heads = next((h for m in model.modules() if isinstance(h := getattr(getattr(m, "config", None),
                                                                        "num_attention_heads", None), int)), None)
    plan: dict = {}
    attrs: dict = {}
    whole: dict = {}
    for holder_name, group in _projection_groups(model).items():
        got = _cut_group(model.get_submodule(holder_name), group, hidden, heads, tp)
        if isinstance(got, str):
            whole[holder_name] = got
            continue
        plan.update(got[0])
        if got[1]:
            attrs[holder_name] = got[1]
    return plan, attrs, whole


def parallelize_by_shape(model: nn.Module, group) -> dict[str, str]:
    """Cut ``model`` over ``group`` by the plan the module's rule finds (in place; a warning names
    the groups left whole); returns ``{module path: style}`` of what was cut."""
    plan, attrs, whole = plan_by_shape(model, dist.get_world_size(group))
    if not plan:
        reasons = "; ".join(f"{k}: {v}" for k, v in whole.items()) or "no nn.Linear or Conv1D inside a ModuleList"
        raise ValueError(f"tensor plan by shape: nothing in {type(model).__name__} fits the rule "
                         f"(strategies/parallel/tensor_auto.py) ({reasons}); valid: a tp_plan")
    if whole:
        warnings.warn("tensor plan by shape: left whole on every tensor rank: " +
                      "; ".join(f"{k} ({v})" for k, v in whole.items()))
    cut = parallelize_tensor(model, group, plan)
    for holder_name, values in attrs.items():
        holder = model.get_submodule(holder_name)
        for attr, value in values.items():
            setattr(holder, attr, value)
    return cut
