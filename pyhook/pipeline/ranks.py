"""The rank layout of a capture: which processes there are, how they group, which ones write.

One function, :func:`rank_layout`, answers for the job, the recorder and the stream:

* ``world`` and ``rank`` come from ``torch.distributed`` when a process group is initialised
  (however it was started: torchrun, ``mp.spawn``, Ray Train, a hand-made launcher), else from
  the ``RANK``/``WORLD_SIZE`` environment variables (torchrun's, before the group is joined),
  else one process;
* ``tp_size`` ranks in a row make one tensor-parallel group (``0..N-1``, ``N..2N-1``, ...: the
  layout of transformers' ``DistributedConfig(tp_size=N)`` and of Megatron); the groups are the
  data-parallel ranks (``dp_rank``, ``dp_size = world / tp_size``) that split the corpus;
* the first rank of each tensor-parallel group is its ``writer``: a capture stores each
  (example, position) once, as ``dp_size`` writer ranks of one store. The others run the same
  forwards (their collectives are the model's) and store nothing.

``tp_size`` is given (a job's ``tp_size``) or read off the model: transformers records it when
it shards a model (``tp_plan="auto"``, ``DistributedConfig``) as ``model.tp_size`` with its
device mesh's ``"tp"`` dimension; otherwise (torch's ``parallelize_module``) the layout layer
reads it off the modules' parallel styles (:func:`pyhook.distributed.tensor_parallel_ranks`),
and refuses, asking for ``tp_size``, styles it cannot read. FSDP (``fully_shard``) shards weights, not the batch: its
ranks are data-parallel and each writes its own rows.

Importing this module does not import torch.

Example::

    >>> from pyhook.pipeline.ranks import RankLayout
    >>> lay = RankLayout(world=4, rank=3, tp_size=2)
    >>> lay.dp_rank, lay.dp_size, lay.tp_rank, lay.tp_ranks, lay.writer
    (1, 2, 1, [2, 3], False)
    >>> [RankLayout(world=4, rank=r, tp_size=2).writer for r in range(4)]
    [True, False, True, False]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["RankLayout", "model_tp_size", "rank_layout"]


@dataclass(frozen=True)
class RankLayout:
    """This process's place among the ranks of a capture (see the module's docstring).

    ``source`` says where ``world``/``rank`` came from: ``"torch.distributed"``,
    ``"environment"``, ``"arguments"`` or ``"one process"``.
    """

    world: int = 1
    rank: int = 0
    tp_size: int = 1
    source: str = "one process"

    def __post_init__(self) -> None:
        for name in ("world", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"rank must be an int, got {self.rank!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, world={self.world}), got {self.rank}")
        if self.world % self.tp_size:
            raise ValueError(
                f"tp_size {self.tp_size} does not divide the {self.world} ranks "
                f"({self.source}): each tensor-parallel group is tp_size ranks in a row, so the "
                "number of ranks must be a multiple of tp_size"
            )

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group."""
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank: which share of the corpus, which writer rank of the store."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        """The data-parallel groups: the shares of the corpus, the writer ranks of the store."""
        return self.world // self.tp_size

    @property
    def tp_ranks(self) -> list[int]:
        """The global ranks of this rank's tensor-parallel group."""
        first = self.dp_rank * self.tp_size
        return list(range(first, first + self.tp_size))

    @property
    def writer(self) -> bool:
        """Whether this rank writes its group's rows (the first rank of the group)."""
        return self.tp_rank == 0

    @property
    def writer_rank(self) -> int:
        """The global rank that writes this rank's group's rows."""
        return self.tp_ranks[0]

    def describe(self) -> str:
        """One line: ``4 ranks (torch.distributed): 2 data-parallel x 2 tensor-parallel; ranks
        0, 2 write``.

        >>> RankLayout(world=4, rank=0, tp_size=2, source="environment").describe()
        '4 ranks (environment): 2 data-parallel x 2 tensor-parallel; ranks 0, 2 write'
        """
        if self.world == 1:
            return "1 rank: it writes"
        writers = ", ".join(str(r) for r in range(0, self.world, self.tp_size))
        return (
            f"{self.world} ranks ({self.source}): {self.dp_size} data-parallel x "
            f"{self.tp_size} tensor-parallel; rank{'s' if self.dp_size > 1 else ''} "
            f"{writers} write{'' if self.dp_size > 1 else 's'}"
        )


def _dist() -> Any:
    """``torch.distributed`` when torch is imported and a process group is initialised."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def model_tp_size(model: Any) -> int:
    """The tensor-parallel size a model was sharded with (1 when it was not).

    transformers records it when it shards a model (``tp_plan="auto"``,
    ``DistributedConfig(tp_size=N)``): ``model.tp_size`` and the device mesh's ``"tp"``
    dimension; a model that does not record it (torch's ``parallelize_module``) is read by the
    layout layer (:func:`pyhook.distributed.tensor_parallel_ranks`). The groups must be ``tp_size`` ranks in a row (transformers' own layout);
    another layout is refused, naming it.

    >>> import torch
    >>> model_tp_size(torch.nn.Linear(2, 2))
    1
    """
    if model is None:
        return 1
    size = getattr(model, "_tp_size", None)
    ranks: list[int] | None = None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 1:
        if _dist() is None:
            return 1
        # not recorded (torch's parallelize_module): the layout layer reads the styles
        from ..distributed import tensor_parallel_ranks

        ranks = tensor_parallel_ranks(model)
        if ranks is None or len(ranks) == 1:
            return 1
        size = len(ranks)
    mesh = getattr(model, "_device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if ranks is None and mesh is not None and "tp" in names:
        ranks = [int(r) for r in mesh["tp"].mesh.flatten().tolist()]
    if ranks is not None:
        first = ranks[0]
        if len(ranks) != size or first % size or ranks != list(range(first, first + size)):
            raise ValueError(
                f"the model's tensor-parallel group is ranks {ranks} (its device mesh's 'tp' "
                f"dimension): a capture takes groups of tp_size={size} ranks in a row "
                f"(0..{size - 1}, {size}..{2 * size - 1}, ...), as transformers lays them out"
            )
    return size


def rank_layout(
    *,
    tp_size: int | None = None,
    model: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> RankLayout:
    """This process's :class:`RankLayout`: ``rank``/``world_size`` when given, else
    ``torch.distributed``'s when initialised, else ``RANK``/``WORLD_SIZE``, else one process;
    ``tp_size`` when given, else the model's (:func:`model_tp_size`), else 1.

    >>> rank_layout().world, rank_layout(rank=1, world_size=2).source
    (1, 'arguments')
    """
    if rank is not None or world_size is not None:
        world = 1 if world_size is None else world_size
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world_size must be an int >= 1 (processes), got {world!r}")
        r = 0 if rank is None else rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise ValueError(f"rank must be an int in [0, world_size={world}), got {r!r}")
        source = "arguments"
    elif (dist := _dist()) is not None:
        r, world, source = dist.get_rank(), dist.get_world_size(), "torch.distributed"
    elif "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        try:
            r, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise ValueError(
                f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}: "
                "the environment's ranks must be integers"
            ) from None
        source = "environment"
    else:
        r, world, source = 0, 1, "one process"
    try:
        model_tp = model_tp_size(model)
    except ValueError as e:
        from ..distributed import LayoutError

        if tp_size is None or not isinstance(e, LayoutError):
            raise
        model_tp = 1  # the layout layer cannot tell; the tp_size given decides
    if tp_size is None:
        tp = model_tp
    else:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        if model_tp > 1 and tp_size != model_tp:
            raise ValueError(
                f"tp_size={tp_size}, but the model was sharded over {model_tp} tensor-parallel "
                "ranks (model.tp_size): give the model's"
            )
        tp = tp_size
    if source == "arguments" and tp > 1:
        # explicit rank/world_size name a writer of the store: one rank per data-parallel group
        raise ValueError(
            f"rank/world_size name this process's writer rank in the store; with a tensor-"
            f"parallel model (tp_size={tp}) leave them out: they come from torch.distributed"
        )
    return RankLayout(world=world, rank=r, tp_size=tp, source=source)
