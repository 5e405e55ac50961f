"""Lightning Fabric's collectives (``lightning.fabric.plugins.collectives`` ->
``zerotrain.fabric.plugins.collectives``, registered by ``fabric_paths.py``): an object that owns one
process group and runs ``torch.distributed``'s calls over it.

``TorchCollective().setup(backend=...)`` starts the default group when none is running (``main_address``
/ ``main_port`` fill ``MASTER_ADDR`` / ``MASTER_PORT`` for that call only, where they are unset);
``create_group(ranks=...)`` makes a group and keeps it as the collective's own (once: a second one is a
RuntimeError), ``new_group(ranks=...)`` makes one and only returns it. A collective with no group of
its own works over the default group, and keeps that as its group from the first use. Every call passes
its group to ``torch.distributed``, so ``src``/``dst`` are the global ranks as there, and returns what
it filled (the tensor, or the list). A rank outside the group gets -1 from ``rank``/``world_size`` and
``barrier`` returns at once. ``teardown`` destroys the collective's group, and the default group too when
a ``setup`` started it and nothing else is left.

Lightning's examples/fabric/reinforcement_learning/train_fabric_decoupled.py runs over three of them
(bench/CONFORMANCE.md); ``SingleDeviceCollective`` is the one-process form whose calls hand their input
back."""
from __future__ import annotations

import datetime
import os
from abc import ABC, abstractmethod
from typing import Any, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist

_DIST = dist.is_available()
if _DIST:
    from torch.distributed import ReduceOp
    RedOpType = ReduceOp.RedOpType
else:  # a torch built without distributed: the op types only serve isinstance checks
    ReduceOp = RedOpType = type("ReduceOp", (), {})


@runtime_checkable
class CollectibleGroup(Protocol):
    """What a process group offers the collectives (``torch.distributed.ProcessGroup`` has both)."""

    def size(self) -> int: ...

    def rank(self) -> int: ...


class Collective(ABC):
    """One group and the collective calls over it; the subclass says how groups are made."""

    def __init__(self) -> None:
        self._group: Optional[CollectibleGroup] = None

    @property
    def group(self) -> CollectibleGroup:
        if self._group is None:
            raise RuntimeError(f"`{type(self).__name__}` does not own a group. HINT: try "
                               "`collective.create_group().group`")
        return self._group

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor: ...

    @abstractmethod
    def reduce(self, tensor: torch.Tensor, dst: int, op: Any) -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, tensor_list: list, tensor: torch.Tensor) -> list: ...

    @abstractmethod
    def gather(self, tensor: torch.Tensor, gather_list: list, dst: int = 0) -> list: ...

    @abstractmethod
    def scatter(self, tensor: torch.Tensor, scatter_list: list, src: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input_list: list, op: Any) -> torch.Tensor: ...

    @abstractmethod
    def all_to_all(self, output_tensor_list: list, input_tensor_list: list) -> list: ...

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def barrier(self, device_ids: Optional[list] = None) -> None: ...

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    @classmethod
    @abstractmethod
    def is_initialized(cls) -> bool: ...

    @classmethod
    @abstractmethod
    def init_group(cls, **kwargs: Any) -> None: ...

    @classmethod
    @abstractmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup: ...

    @classmethod
    @abstractmethod
    def destroy_group(cls, group: CollectibleGroup) -> None: ...

    @classmethod
    @abstractmethod
    def _convert_to_native_op(cls, op: Any) -> Any: ...

    def setup(self, **kwargs: Any) -> "Collective":
        """Start the default group (``init_group(**kwargs)``) unless it runs already."""
        if not self.is_initialized():
            self.init_group(**kwargs)
        return self

    def create_group(self, **kwargs: Any) -> "Collective":
        """Make a group (``new_group(**kwargs)``) and own it; the default group must be running."""
        if self._group is not None:
            raise RuntimeError(f"`{type(self).__name__}` already owns a group.")
        self._group = self.new_group(**kwargs)
        return self

    def teardown(self) -> "Collective":
        """Destroy the owned group."""
        if self._group is None:
            raise RuntimeError(f"`{type(self).__name__}` does not own a group to destroy.")
        self.destroy_group(self._group)
        self._group = None
        return self


class TorchCollective(Collective):
    """The collective calls of ``torch.distributed`` over the owned group (module docstring)."""

    #: a ``setup`` of some instance started the default group (so a ``teardown`` may end it)
    manages_default_group = False
    addr_key = "MASTER_ADDR"
    port_key = "MASTER_PORT"

    def __init__(self) -> None:
        if not dist.is_available():
            raise RuntimeError("Torch distributed is not available.")
        super().__init__()

    @property
    def group(self) -> CollectibleGroup:
        if self._group is None:  # no group made: the default one, kept from now on
            self._group = dist.GroupMember.WORLD
        return super().group

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    # ------------------------------------------------------------------ tensors
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src, group=self.group)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        dist.all_reduce(tensor, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def reduce(self, tensor: torch.Tensor, dst: int, op: Any = "sum") -> torch.Tensor:
        dist.reduce(tensor, dst, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def all_gather(self, tensor_list: list, tensor: torch.Tensor) -> list:
        dist.all_gather(tensor_list, tensor, group=self.group)
        return tensor_list

    def gather(self, tensor: torch.Tensor, gather_list: list, dst: int = 0) -> list:
        dist.gather(tensor, gather_list, dst, group=self.group)
        return gather_list

    def scatter(self, tensor: torch.Tensor, scatter_list: list, src: int = 0) -> torch.Tensor:
        dist.scatter(tensor, scatter_list, src, group=self.group)
        return tensor

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op: Any = "sum") -> torch.Tensor:
        dist.reduce_scatter(output, input_list, op=self._convert_to_native_op(op), group=self.group)
        return output

    def all_to_all(self, output_tensor_list: list, input_tensor_list: list) -> list:
        dist.all_to_all(output_tensor_list, input_tensor_list, group=self.group)
        return output_tensor_list

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        dist.send(tensor, dst, tag=tag, group=self.group)

    def recv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> torch.Tensor:
        dist.recv(tensor, src, tag=tag, group=self.group)
        return tensor

    # ------------------------------------------------------------------ picklable objects
    def all_gather_object(self, object_list: list, obj: Any) -> list:
        dist.all_gather_object(object_list, obj, group=self.group)
        return object_list

    def broadcast_object_list(self, object_list: list, src: int, device: Optional[torch.device] = None) -> list:
        dist.broadcast_object_list(object_list, src, group=self.group, device=device)
        return object_list

    def gather_object(self, obj: Any, object_gather_list: list, dst: int = 0) -> list:
        dist.gather_object(obj, object_gather_list, dst, group=self.group)
        return object_gather_list

    def scatter_object_list(self, scatter_object_output_list: list, scatter_object_input_list: list,
                            src: int = 0) -> list:
        dist.scatter_object_list(scatter_object_output_list, scatter_object_input_list, src, group=self.group)
        return scatter_object_output_list

    # ------------------------------------------------------------------ synchronization
    def barrier(self, device_ids: Optional[list] = None) -> None:
        if self.group == dist.GroupMember.NON_GROUP_MEMBER:
            return  # not a member: nothing to wait for
        dist.barrier(group=self.group, device_ids=device_ids)

    def monitored_barrier(self, timeout: Optional[datetime.timedelta] = None, wait_all_ranks: bool = False) -> None:
        dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=wait_all_ranks)

    # ------------------------------------------------------------------ groups
    def setup(self, main_address: Optional[str] = None, main_port: Optional[str] = None,
              **kwargs: Any) -> "TorchCollective":
        if self.is_initialized():
            return self
        lent = [key for key, value in ((self.addr_key, main_address), (self.port_key, main_port))
                if value is not None and key not in os.environ]
        for key in lent:
            os.environ[key] = str(main_address if key == self.addr_key else main_port)
        try:
            super().setup(**kwargs)
            TorchCollective.manages_default_group = True  # every instance sees it
        finally:
            for key in lent:
                os.environ.pop(key, None)
        return self

    def teardown(self) -> "TorchCollective":
        member = self.group != dist.GroupMember.NON_GROUP_MEMBER
        super().teardown()
        if not TorchCollective.manages_default_group:
            return self
        world = dist.GroupMember.WORLD
        if world is None:  # destroyed by someone else
            TorchCollective.manages_default_group = False
        elif member and len(dist.distributed_c10d._pg_map) == 1:  # only the default group is left
            self.destroy_group(world)
            TorchCollective.manages_default_group = False
        return self

    @classmethod
    def is_available(cls) -> bool:
        return dist.is_available()

    @classmethod
    def is_initialized(cls) -> bool:
        return cls.is_available() and dist.is_initialized()

    @classmethod
    def init_group(cls, **kwargs: Any) -> None:
        dist.init_process_group(**kwargs)

    @classmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        return dist.new_group(**kwargs)

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        # every rank may call it; a rank outside the group holds a placeholder that is not registered
        if group in dist.distributed_c10d._pg_map:
            dist.destroy_process_group(group)

    @classmethod
    def _convert_to_native_op(cls, op: Any) -> Any:
        """``op`` as ``torch.distributed``'s: a ReduceOp as it is, a name (any case) looked up on it."""
        if isinstance(op, (ReduceOp, RedOpType)):
            return op
        if not isinstance(op, str):
            raise ValueError(f"Unsupported op {op!r} of type {type(op).__name__}")
        native = getattr(ReduceOp, op.upper(), None)
        if native is None:
            raise ValueError(f"op {op.upper()!r} is not a member of `ReduceOp`")
        return native


class SingleDeviceCollective(Collective):
    """One process: every call hands its input back (a scatter or reduce-scatter its list's first
    entry, an all-to-all its input list, a gather or all-gather ``[tensor]``)."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def broadcast(self, tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return tensor

    def all_reduce(self, tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, **__: Any) -> list:
        return [tensor]

    def gather(self, tensor: torch.Tensor, *_: Any, **__: Any) -> list:
        return [tensor]

    def scatter(self, tensor: torch.Tensor, scatter_list: list, *_: Any, **__: Any) -> torch.Tensor:
        return scatter_list[0]

    def reduce_scatter(self, output: torch.Tensor, input_list: list, *_: Any, **__: Any) -> torch.Tensor:
        return input_list[0]

    def all_to_all(self, output_tensor_list: list, input_tensor_list: list, *_: Any, **__: Any) -> list:
        return input_tensor_list

    def send(self, *_: Any, **__: Any) -> None:
        pass

    def recv(self, tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return tensor

    def barrier(self, *_: Any, **__: Any) -> None:
        pass

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def is_initialized(cls) -> bool:
        return True

    @classmethod
    def init_group(cls, **_: Any) -> None:
        pass

    @classmethod
    def new_group(cls, **_: Any) -> CollectibleGroup:
        return object()  # a placeholder: nothing to communicate over

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        pass

    @classmethod
    def _convert_to_native_op(cls, op: Any) -> Any:
        return op


__all__ = ["Collective", "TorchCollective", "SingleDeviceCollective", "CollectibleGroup"]
