"""Adam/AdamW on CPU with the one-pass fused kernel: a functional step and an Optimizer.

:func:`fused_adam_step` updates one flat slice in place (what the offload strategy calls on its
fp32 master shard); :class:`CPUAdam` is a ``torch.optim.Optimizer`` built on it. Both use the
native kernel (zerotrain/csrc/adam/cpu_adam.cpp) when it builds, else the pure-torch fallback
(:mod:`zerotrain.ops.reference`), with the same results to rounding.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import builder
from .deepspeed_adam import DS_VECTOR_BLOCK, DeepSpeedBetaPowers, deepspeed_adam_reference, deepspeed_beta_powers
from .reference import AdamHyper, fallback_adam_step, stochastic_rounding_key

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)


def _check_tensor(t: torch.Tensor, name: str, numel: int, dtypes: tuple, allowed: str, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fused_adam_step: `{name}` must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"fused_adam_step: `{name}` must be {allowed}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"fused_adam_step: `{name}` is on {t.device} but `master` is on {device}")
    if not t.is_contiguous():
        raise ValueError(
            f"fused_adam_step: `{name}` must be contiguous (call .contiguous() or pass a flat "
            "buffer slice)"
        )
    if t.numel() != numel:
        raise ValueError(
            f"fused_adam_step: `{name}` has {t.numel()} elements but `master` has {numel}"
        )


def check_inputs(master, grad, exp_avg, exp_avg_sq, param_out, h: AdamHyper) -> None:
    """The checks the native kernel makes, in Python, for the fallback path (same messages)."""
    if not isinstance(master, torch.Tensor):
        raise TypeError(f"fused_adam_step: `master` must be a tensor, got {type(master).__name__}")
    n, device = master.numel(), master.device
    _check_tensor(master, "master", n, _GRAD_DTYPES,
                  "float32, bfloat16 or float16 (a 16-bit master is stepped in fp32, rounded once)", device)
    _check_tensor(grad, "grad", n, _GRAD_DTYPES, "float32, bfloat16 or float16", device)
    _check_tensor(exp_avg, "exp_avg", n, _STATE_DTYPES, "float32 or bfloat16", device)
    _check_tensor(exp_avg_sq, "exp_avg_sq", n, _STATE_DTYPES, "float32 or bfloat16", device)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(
            f"fused_adam_step: `exp_avg` ({exp_avg.dtype}) and `exp_avg_sq` ({exp_avg_sq.dtype}) "
            "must have the same dtype"
        )
    if master.dtype != torch.float32 and grad.dtype != master.dtype:
        raise TypeError(f"fused_adam_step: a {master.dtype} `master` takes a gradient of its own dtype (as the "
                        f"optimizer reads it), got {grad.dtype}")
    if master.dtype != torch.float32 and param_out is not None:
        raise ValueError(f"fused_adam_step: a {master.dtype} `master` is the working copy itself; `param_out` "
                         "must be None")
    named = [(master, "master"), (grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")]
    if param_out is not None:
        _check_tensor(param_out, "param_out", n, _OUT_DTYPES, "bfloat16 or float16", device)
        named.append((param_out, "param_out"))
    for i, (a, name_a) in enumerate(named):
        for b, name_b in named[i + 1:]:
            if a.numel() and b.numel():
                a0, b0 = a.data_ptr(), b.data_ptr()
                if not (a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0):
                    raise ValueError(
                        f"fused_adam_step: `{name_a}` and `{name_b}` share memory; each needs its "
                        "own buffer"
                    )
    if not h.lr >= 0.0:
        raise ValueError(f"fused_adam_step: `lr` must be >= 0, got {h.lr}")
    for name, beta in (("beta1", h.beta1), ("beta2", h.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"fused_adam_step: `{name}` must be in [0, 1), got {beta}")
    if not h.eps >= 0.0:
        raise ValueError(f"fused_adam_step: `eps` must be >= 0, got {h.eps}")
    if not h.weight_decay >= 0.0:
        raise ValueError(f"fused_adam_step: `weight_decay` must be >= 0, got {h.weight_decay}")
    if h.bias_correction and h.step < 1:
        raise ValueError(
            f"fused_adam_step: `step` must be >= 1 (the step being taken, counted from 1), got "
            f"{h.step}"
        )


def fused_adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    param_out: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    n_threads: Optional[int] = None,
    isa: Optional[str] = None,
    order: str = "torch",
    beta_powers: Optional[tuple[float, float]] = None,
    tail: Optional[Sequence[tuple[int, int]]] = None,
    **hyper: Any,
) -> None:
    """One in-place Adam/AdamW step on a flat slice, in one pass over memory.

    Args:
        master: fp32 master weights, updated in place; or a bf16/fp16 master (ZeRO's
            ``master_dtype``: the working copy itself), read into fp32, stepped there and rounded
            to nearest even once; its gradient then has its dtype and there is no ``param_out``.
        grad: fp32, bf16 or fp16 gradient (read only), multiplied by ``grad_scale`` first (fold
            the loss scale's inverse and the clip coefficient into it).
        exp_avg, exp_avg_sq: Adam state, both fp32 or both bf16, updated in place. bf16 state is
            rounded to nearest even, or stochastically with ``stochastic_rounding`` (the noise is
            a hash of ``seed``, ``step`` and the element index: reproducible, thread-count
            independent).
        param_out: optional bf16/fp16 tensor that receives the new master rounded to nearest even
            (equal to ``master.to(param_out.dtype)``), written in the same pass.
        n_threads: OpenMP threads (default ``torch.get_num_threads()``).
        isa: force "avx512", "avx2" or "scalar" (default: $ZEROTRAIN_ADAM_ISA, else the best the
            CPU has). Ignored by the fallback.
        order: "torch" (default): torch.optim.Adam/AdamW's operation order; "deepspeed": DeepSpeed
            0.19.8's host kernel's (``ds_adam_step``, what ``DeepSpeedCPUAdam`` runs), bit for bit
            (csrc/adam/cpu_adam.cpp; CPU tensors only).
        beta_powers: with ``order="deepspeed"``, the fp32 ``(beta1^step, beta2^step)`` DeepSpeed's
            optimizer object holds (:class:`~zerotrain.ops.deepspeed_adam.DeepSpeedBetaPowers`);
            default: those of a run that took steps 1, 2, ..., ``step``.
        tail: with ``order="deepspeed"``, the ``[start, end)`` element ranges DeepSpeed's scalar tail
            steps, when the slice is not DeepSpeed's own call (ZeRO-3's flat partition holds other
            elements than this slice: ``zerotrain.deepspeed``'s stage 3); every other element gets
            its vector step. Default None: the last ``numel % 16`` elements of this call.
        hyper: the fields of :class:`~zerotrain.ops.reference.AdamHyper`: ``step`` (the step being
            taken, counted from 1; bias correction uses it), ``lr``, ``beta1``, ``beta2``,
            ``eps``, ``weight_decay``, ``adamw`` (True: decoupled weight decay, AdamW; False: L2
            added to the gradient, Adam), ``bias_correction=True``, ``grad_scale=1.0``.

    All tensors must be contiguous, on the same device, with ``master``'s number of elements, and
    must not share memory. Alignment is not required (64-byte alignment is a little faster).
    CUDA tensors go to the multi-tensor CUDA kernel (:mod:`zerotrain.ops.cuda_adam`).
    """
    h = AdamHyper.of("fused_adam_step", hyper)
    if order not in ("torch", "deepspeed"):
        raise ValueError(f"fused_adam_step: order={order!r}; valid: 'torch', 'deepspeed'")
    if order == "deepspeed":
        if isinstance(master, torch.Tensor) and master.device.type != "cpu":
            raise ValueError(f"fused_adam_step: order='deepspeed' is DeepSpeed's host kernel; `master` is on "
                             f"{master.device}, valid: a CPU tensor")
        if beta_powers is None:
            beta_powers = deepspeed_beta_powers(h.beta1, h.beta2, h.step)
        if tail is not None:
            _step_with_tail(master, grad, exp_avg, exp_avg_sq, param_out, tail,
                            dict(stochastic_rounding=stochastic_rounding, seed=seed, n_threads=n_threads,
                                 isa=isa, order=order, beta_powers=beta_powers, **hyper))
            return
    if isinstance(master, torch.Tensor) and master.is_cuda:
        from .cuda_adam import multi_tensor_adam_step

        multi_tensor_adam_step([master], [grad], [exp_avg], [exp_avg_sq],
                               param_outs=None if param_out is None else [param_out], **hyper)
        return
    module = builder.cpu_adam_module()
    if module is None and order == "deepspeed":
        check_inputs(master, grad, exp_avg, exp_avg_sq, param_out, h)
        deepspeed_adam_reference(master, grad, exp_avg, exp_avg_sq, param_out=param_out, beta_powers=beta_powers,
                                 stochastic_rounding=stochastic_rounding, seed=seed, **hyper)
        return
    if module is None:
        check_inputs(master, grad, exp_avg, exp_avg_sq, param_out, h)
        if master.dtype != torch.float32:  # a 16-bit master: stepped in fp32, rounded once
            wide = master.float()
            fallback_adam_step(wide, grad, exp_avg, exp_avg_sq, stochastic_rounding=stochastic_rounding,
                               seed=seed, **hyper)
            master.copy_(wide)
            return
        fallback_adam_step(master, grad, exp_avg, exp_avg_sq, param_out=param_out,
                           stochastic_rounding=stochastic_rounding, seed=seed, **hyper)
        return
    module.adam_step(
        master, grad, exp_avg, exp_avg_sq, param_out, *h.native_args(),
        bool(stochastic_rounding), stochastic_rounding_key(int(seed), int(h.step)),
        int(n_threads or 0), isa or "", order, *(beta_powers or (0.0, 0.0)),
    )


def _step_with_tail(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    param_out: Optional[torch.Tensor], tail: Sequence[tuple[int, int]], kw: dict[str, Any]) -> None:
    """``fused_adam_step(order="deepspeed", tail=...)``: DeepSpeed's kernel steps the last ``numel % 16``
    elements of a call with its scalar-tail products, so the elements of ``tail`` go in calls of at
    most 15 elements (all tail), every other run in a call of whole 16-element blocks and its rest
    in a zero-padded 16-element copy (zeros step to zeros), so none of them is a tail."""
    flat = [None if t is None else t.view(-1) for t in (master, grad, exp_avg, exp_avg_sq, param_out)]
    n = master.numel()
    block = DS_VECTOR_BLOCK

    def call(a: int, b: int) -> None:
        fused_adam_step(*(t[a:b] for t in flat[:4]), param_out=None if flat[4] is None else flat[4][a:b], **kw)

    def padded(a: int, b: int) -> None:
        pad = [None if t is None else torch.zeros(block, dtype=t.dtype) for t in flat]
        for t, c in zip(flat, pad):
            if t is not None:
                c[:b - a] = t[a:b]
        fused_adam_step(*pad[:4], param_out=pad[4], **kw)
        for t, c in zip(flat, pad):
            if t is not None and t is not flat[1]:
                t[a:b] = c[:b - a]

    def vector(a: int, b: int) -> None:
        whole = a + (b - a) // block * block
        if whole > a:
            call(a, whole)
        if b > whole:
            padded(whole, b)

    at = 0
    for lo, hi in sorted((max(0, lo), min(n, hi)) for lo, hi in tail):
        lo = max(lo, at)
        if lo >= hi:
            continue
        vector(at, lo)
        for a in range(lo, hi, block - 1):
            call(a, min(a + block - 1, hi))
        at = hi
    vector(at, n)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 CPU parameters, one fused pass per parameter.

    ``adamw_mode=True`` (default) is ``torch.optim.AdamW``; False is ``torch.optim.Adam`` with L2
    weight decay. ``state_dtype=torch.bfloat16`` halves the state memory (rounded to nearest even,
    or stochastically with ``stochastic_rounding=True``). Gradients may be fp32, bf16 or fp16.
    The state layout (``step``, ``exp_avg``, ``exp_avg_sq``) is torch's, so fp32 state dicts move
    between this and ``torch.optim.AdamW``.

    ``order="deepspeed"`` steps as DeepSpeed's ``DeepSpeedCPUAdam`` does, bit for bit (see
    :func:`fused_adam_step`; its fp32 ``beta^step`` pair is this optimizer's, as DeepSpeed's is
    its C++ object's) and then also takes bf16/fp16 parameters (stepped in fp32, rounded once).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        state_dtype: torch.dtype = torch.float32,
        *,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None,
        n_threads: Optional[int] = None,
        order: str = "torch",
    ) -> None:
        if order not in ("torch", "deepspeed"):
            raise ValueError(f"CPUAdam: order={order!r}; valid: 'torch', 'deepspeed'")
        if not lr >= 0.0:
            raise ValueError(f"CPUAdam: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"CPUAdam: betas must be two values in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"CPUAdam: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"CPUAdam: weight_decay must be >= 0, got {weight_decay}")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(
                f"CPUAdam: state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}"
            )
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"CPUAdam: n_threads must be >= 1 or None, got {n_threads}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = (torch.initial_seed() if seed is None else seed) & 0xFFFFFFFF
        self.n_threads = n_threads
        self.order = order
        self._beta_powers = DeepSpeedBetaPowers(tuple(betas))
        #: ``order="deepspeed"``: slot (parameter position, group after group) -> ``fused_adam_step``'s
        #: ``tail`` (zerotrain.deepspeed's ZeRO-3 sets it); None: each call's own
        self.kernel_tail: Optional[dict[int, list[tuple[int, int]]]] = None

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype,
                                                memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype,
                                                   memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):  # load_state_dict casts state to the param dtype
            if state[key].dtype != self.state_dtype or not state[key].is_contiguous():
                state[key] = state[key].to(self.state_dtype).contiguous()
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                wide = p.dtype == torch.float32 or (self.order == "deepspeed" and p.dtype in _GRAD_DTYPES)
                if not wide or p.device.type != "cpu" or not p.is_contiguous():
                    raise ValueError(
                        "CPUAdam updates contiguous fp32 CPU parameters in place; got a parameter "
                        f"of shape {tuple(p.shape)}, {p.dtype} on {p.device}"
                        f"{'' if p.is_contiguous() else ', non-contiguous'}. Keep fp32 master "
                        "weights on the CPU (or use torch.optim.AdamW)."
                    )
                state = self._state_for(p)
                state["step"] += 1
                step = int(state["step"].item())
                powers = self._beta_powers.advance(step, beta1, beta2) if self.order == "deepspeed" else None
                fused_adam_step(
                    p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], step=step,
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw=group["adamw_mode"],
                    bias_correction=group["bias_correction"],
                    stochastic_rounding=self.stochastic_rounding,
                    seed=self.seed + 0x632BE5AB * index, n_threads=self.n_threads,
                    order=self.order, beta_powers=powers,
                    tail=None if self.kernel_tail is None else self.kernel_tail.get(index - 1, []),
                )
        return loss
