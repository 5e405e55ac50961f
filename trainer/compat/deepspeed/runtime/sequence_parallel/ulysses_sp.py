"""``deepspeed.runtime.sequence_parallel.ulysses_sp`` (ALST, DeepSpeed 0.19.8): Ulysses for a
Hugging Face model, on ``zerotrain.strategies.parallel``.

* ``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation,
  sequence_parallel_size, micro_batch_size, ...)``: makes the sequence-parallel groups
  (``parallel_state_sp``, returned as DeepSpeed's ``mpu``) and puts, under the model's own
  attention implementation's name, a function that runs that implementation over the whole
  sequence for this rank's heads (``ulysses_attention``'s all-to-alls around it; the shard-sized
  mask transformers builds is dropped: the attention is causal over the whole sequence).
* ``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)``: every rank of a
  sequence group draws its own batch; the group gathers them and each rank yields, one after the
  other, its shard of each (``len(dl) * sp`` micro-batches an epoch), with ``labels`` replaced by
  ``shift_labels`` (the next token, -100 after the last), shifted before the cut.

Differences: only ``sdpa`` (and other attention functions taking ``[B, heads, S, D]`` with no mask)
are tested; flex attention's block masks and ``disable_in_eval`` are refused; DeepSpeed's tiled
MLP / logits-loss helpers are not provided.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ......strategies.parallel.ulysses import ulysses_attention
from . import parallel_state_sp


class UlyssesSPAttentionHF(torch.nn.Module):
    """The attention over ``process_group`` that ``register_with_transformers`` installs."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        if disable_in_eval:
            raise NotImplementedError("UlyssesSPAttentionHF: disable_in_eval=True is not supported by zerotrain; "
                                      "valid: False")
        sp = dist.get_world_size(process_group)
        if attn_head_count % sp:
            raise ValueError(f"UlyssesSPAttentionHF: {attn_head_count} attention heads cannot be split over "
                             f"sequence_parallel_size={sp}; valid: a size dividing the head count")
        self.attn, self.process_group, self.world_size = attn, process_group, sp
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size, self.attn_head_count, self.attn_head_size = batch_size, attn_head_count, attn_head_size
        self.global_kv_head_count, self.num_hidden_layers = kv_head_count, num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.core_attn_implementation: str | None = None

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise NotImplementedError("UlyssesSPAttentionHF: an attention mask reached the attention (flex "
                                      "attention's block masks are not supported); valid: causal attention")

        def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # the core implementation takes [B, heads, S, D] and returns [B, S, heads, D]
            out, _ = self.attn(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, *args, **kwargs)
            return out

        # transformers hands [B, heads, S/sp, D]; ulysses_attention takes [B, S/sp, heads, D]
        out = ulysses_attention(*(t.transpose(1, 2) for t in (query, key, value)), self.process_group,
                                attention=local)
        return out, None

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """DeepSpeed's registration: None for ``sequence_parallel_size`` 1, else the ``mpu``."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("UlyssesSPAttentionHF.register_with_transformers: seq_length=None with "
                             "seq_length_is_variable=False; valid: a fixed seq_length (or max_length), or "
                             "seq_length_is_variable=True")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        active = getattr(config, "_attn_implementation", None) if loaded else None
        if active is not None and active != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                             f"attn_implementation='{active}'; valid: the same value for both")
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't supported by Ulysses sequence "
                             "parallelism (it needs a 4D attention_mask); valid: 'sdpa' or a flash attention")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r} is not one of transformers' "
                             f"attention functions; valid: {ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        arch = config.get_text_config()
        local = None if seq_length_is_variable else seq_length // sequence_parallel_size
        uattn = cls(ALL_ATTENTION_FUNCTIONS[core_attn_implementation], micro_batch_size, arch.num_attention_heads,
                    getattr(arch, "head_dim", arch.hidden_size // arch.num_attention_heads),
                    arch.num_key_value_heads, arch.num_hidden_layers, parallel_state_sp.get_sequence_parallel_group(),
                    seq_length_is_variable, local, None if seq_length_is_variable else seq_length, disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            # transformers builds a mask for the shard's length: meaningless over the whole sequence
            return uattn(module, query, key, value, None, *args, **kwargs)

        # under the core name, so that transformers' own branches on that name still apply
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = attention
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter:
    """Iterates ``dl`` as a sequence group: see the module's doc."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size, self.device = dl, sp_rank, sp_group, sp_world_size, device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Collective over the sequence group: one batch from each rank, this rank's shard of each.

        The ranks first exchange one header each (ended, or an error, or each key's shape and dtype),
        so that an exhausted loader or a bad batch on one rank is raised on every rank of the group
        before any tensor collective, rather than leaving its peers waiting in one."""
        try:
            batch, header = next(self.iter), None
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh
            batch, header = None, "end"
        if header is None:
            header = self._header(batch)
        headers: list = [None] * self.sp_world_size
        dist.all_gather_object(headers, header, group=self.sp_group)
        if "end" in headers:
            if header != "end":  # the peers' loaders ran out first: this rank's next epoch restarts too
                self.iter = iter(self.dl)
            raise StopIteration
        for r, h in enumerate(headers):
            if isinstance(h, str):
                raise ValueError(f"UlyssesSPDataLoaderAdapter, sequence-parallel rank {r}: {h}")
        if len({tuple(h["__keys__"]) for h in headers}) > 1:
            keys = ", ".join(f"rank {r} {h['__keys__']}" for r, h in enumerate(headers))
            raise ValueError(f"UlyssesSPDataLoaderAdapter: the sequence-parallel ranks' batches have different keys "
                             f"({keys}); valid: the same keys on every rank")
        for key in header["__keys__"]:  # a tensor on every rank or on none, of one dtype: one kind of gather
            kinds = [h[key][1] if key in h else "not a tensor" for h in headers]
            if len(set(map(str, kinds))) > 1:
                found = ", ".join(f"rank {r} {k}" for r, k in enumerate(kinds))
                raise ValueError(f"UlyssesSPDataLoaderAdapter: batch[{key!r}] differs between the sequence-parallel "
                                 f"ranks ({found}); valid: the same type and dtype on every rank")
        gathered: list[dict] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                parts = [torch.empty(h[key][0], dtype=h[key][1], device=self.device) for h in headers]
                with torch.no_grad():
                    dist.all_gather(parts, value.to(self.device).contiguous(), group=self.sp_group)
            else:
                parts = [None] * self.sp_world_size
                dist.all_gather_object(parts, value, group=self.sp_group)
            for r, part in enumerate(parts):
                gathered[r][key] = part
        for micro in gathered:
            self.micro_batches.append(self._shard(micro))

    @staticmethod
    def _header(batch: Any) -> Any:
        """What the peers must know of this rank's batch before gathering it, or what is wrong with it."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            return "a batch must be a dict with `input_ids`; valid: a dict of [batch, sequence] tensors"
        if "position_ids" not in batch:
            return ("Ulysses SP requires `position_ids` in every dataloader batch (each token keeps its global "
                    "position after the sequence is cut); valid: a collator that adds them")
        shape = tuple(batch["input_ids"].shape)
        header: dict = {"__keys__": list(batch)}
        for key, value in batch.items():
            if torch.is_tensor(value):
                if tuple(value.shape[:2]) != shape[:2]:
                    return (f"batch[{key!r}] has shape {tuple(value.shape)}, input_ids {shape}; valid: the same "
                            "[batch, sequence] shape")
                header[key] = (tuple(value.shape), value.dtype)
        return header

    def _shard(self, batch: dict) -> dict:
        length = batch["input_ids"].shape[1]
        if length % self.sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: a sequence of {length} tokens cannot be cut into "
                             f"{self.sp_world_size} equal shards; valid: a length divisible by the sequence-parallel size")
        labels = batch.pop("labels")  # the next token of each, shifted before the cut (-100 after the last)
        batch["shift_labels"] = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
        chunk = length // self.sp_world_size
        return {k: v[:, chunk * self.sp_rank:chunk * (self.sp_rank + 1)].cpu() if torch.is_tensor(v) else v
                for k, v in batch.items()}
