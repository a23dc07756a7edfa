"""Counts the collectives torch DTensor issues and the bytes each rank sends, at torch's
dispatcher (the torch baseline has no counter of its own like hypershard's _C.traffic())."""

from __future__ import annotations


class CollectiveBytes:
    """Counts collectives and the bytes this rank sends, at torch's dispatcher, for the torch
    DTensor baseline: functional collectives (what DTensor redistributions issue) and c10d ops
    (dist.all_reduce etc.). Bytes follow hypershard's cost model (docs/layout.md): all_reduce =
    reduce_scatter + all_gather of torch.chunk pieces, all_gather sends (k-1) x input,
    reduce_scatter / all_to_all send all but the kept piece."""

    def __init__(self):
        self.collectives = 0
        self.bytes_sent = 0
        self.by_op: dict = {}
        self.unaccounted = 0  # collectives whose bytes could not be read from their arguments
        self.mode = None

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        funcol = torch.ops._c10d_functional
        c10d = torch.ops.c10d

        def group_of(name_or_pg):
            from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group

            if isinstance(name_or_pg, str):  # functional collectives name their group
                return _resolve_process_group(name_or_pg)
            if isinstance(name_or_pg, torch.ScriptObject):  # c10d ops pass it boxed
                return ProcessGroup.unbox(name_or_pg)
            return name_or_pg

        def chunk_len(n: int, k: int, i: int) -> int:
            size = -(-n // k) if n else 0
            return max(0, min(size, n - size * i)) if size else 0

        def sent_all_reduce(n, pg):
            k, i = pg.size(), pg.rank()
            own = chunk_len(n, k, i)
            return (n - own) + (k - 1) * own

        def account(func, args):
            packet = func.overloadpacket
            t = args[0]
            if packet is funcol.all_reduce or packet is funcol.all_reduce_:
                pg = group_of(args[2])
                return sent_all_reduce(t.numel(), pg) * t.element_size()
            if packet is funcol.all_reduce_coalesced or packet is funcol.all_reduce_coalesced_:
                pg = group_of(args[2])
                return sum(sent_all_reduce(x.numel(), pg) * x.element_size() for x in t)
            if packet is funcol.all_gather_into_tensor or packet is funcol.all_gather_into_tensor_out:
                return (int(args[1]) - 1) * t.numel() * t.element_size()
            if packet is funcol.reduce_scatter_tensor:
                k = int(args[2])
                return (t.numel() - t.numel() // k) * t.element_size()
            if packet is funcol.all_to_all_single:
                pg = group_of(args[3])
                splits = args[2]
                n = t.numel()
                keep = n // pg.size() if not splits else n // t.size(0) * splits[pg.rank()]
                return (n - keep) * t.element_size()
            if packet is funcol.broadcast or packet is funcol.broadcast_:
                pg = group_of(args[2])
                return (pg.size() - 1) * t.numel() * t.element_size() if int(args[1]) == pg.rank() else 0
            if packet is c10d.allreduce_:
                pg = group_of(args[1])
                return sum(sent_all_reduce(x.numel(), pg) * x.element_size() for x in t)
            if packet is c10d._allgather_base_:
                pg = group_of(args[2])
                x = args[1]
                return (pg.size() - 1) * x.numel() * x.element_size()
            if packet is c10d.allgather_:
                inputs = args[1]
                pg = group_of(args[2])
                return sum((pg.size() - 1) * x.numel() * x.element_size() for x in inputs)
            if packet is c10d._reduce_scatter_base_:
                out_t, in_t, pg = args[0], args[1], args[2]
                return (in_t.numel() - out_t.numel()) * in_t.element_size()
            if packet is c10d.alltoall_base_:
                out_t, in_t, pg = args[0], args[1], group_of(args[2])
                return (in_t.numel() - in_t.numel() // pg.size()) * in_t.element_size()
            if packet is c10d.broadcast_:
                pg = group_of(args[1])
                root = int(args[3])
                return (pg.size() - 1) * sum(x.numel() * x.element_size() for x in t) if root == pg.rank() else 0
            return None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                sent = None
                try:
                    sent = account(func, args)
                except Exception:  # noqa: BLE001 (an unexpected signature: counted, bytes unknown)
                    if "c10d" in str(func.namespace):
                        sent = 0
                        counter.unaccounted += 1
                if sent is not None:
                    name = str(func.overloadpacket).split(".")[-1]
                    counter.collectives += 1
                    counter.bytes_sent += int(sent)
                    slot = counter.by_op.setdefault(name, [0, 0])
                    slot[0] += 1
                    slot[1] += int(sent)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        return False
