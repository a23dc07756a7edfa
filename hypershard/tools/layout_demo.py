"""hypershard demo: the layout core at work (python -m hypershard.tools.layout_demo --help).

Until the runtime lands, the demo shows what the C++ layout core computes for a 2-D tensor on a
2-D mesh (dp, tp): which slice of the global tensor each rank holds (uneven sizes included), the
same layout in the three notations, and the redistribution plans between layouts with the bytes
each rank sends. Everything printed is computed by hypershard._C; this file only formats it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import hypershard as hs

_RULE = "=" * 78

# The layouts shown, in alias notation, plus their Partial axes.
_LAYOUTS = [
    ("A", ("dp", "tp"), None),
    ("B", (("dp", "tp"), "None"), None),
    ("C", ("None", "tp"), {"dp": "sum"}),
    ("R", ("None", "None"), None),
]
# Redistributions shown: (from, to).
_PLANS = [("A", "R"), ("A", "B"), ("C", "A"), ("C", "R"), ("R", "B")]


def _parse_ints(text: str, sep: str) -> list[int]:
    try:
        values = [int(v) for v in text.lower().split(sep)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by '{sep}': {text!r}")
    if len(values) != 2 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected two non-negative integers: {text!r}")
    return values


def _side_by_side(left: list[str], right: list[str], gap: int = 4) -> list[str]:
    width = max((len(line) for line in left), default=0)
    rows = max(len(left), len(right))
    left = left + [""] * (rows - len(left))
    right = right + [""] * (rows - len(right))
    return [f"{a:<{width}}{' ' * gap}{b}".rstrip() for a, b in zip(left, right)]


def _rank_table(layout: hs.Layout) -> list[str]:
    mesh = layout.mesh
    lines = ["rank  coord   local shape  global offset"]
    for position, rank in enumerate(mesh.ranks):
        coord = "(" + ", ".join(str(c) for c in mesh.coordinate_at(position)) + ")"
        shape = str(layout.local_shape_at(position))
        offset = str(layout.global_offset_at(position))
        lines.append(f"{rank:>4}  {coord:<7} {shape:<12} {offset}")
    return lines


def _owner_grid(layout: hs.Layout, max_cells: int) -> list[str]:
    rows, cols = layout.global_shape
    if rows * cols == 0:
        return ["(empty tensor)"]
    if rows > max_cells or cols > max_cells:
        return [f"(grid omitted: larger than {max_cells}x{max_cells})"]
    owners = [[[] for _ in range(cols)] for _ in range(rows)]
    for position, rank in enumerate(layout.mesh.ranks):
        (r0, c0), (nr, nc) = layout.global_offset_at(position), layout.local_shape_at(position)
        for r in range(r0, r0 + nr):
            for c in range(c0, c0 + nc):
                owners[r][c].append(rank)
    sep = "" if max(layout.mesh.ranks) < 10 else ","
    cells = [[sep.join(str(o) for o in cell) for cell in row] for row in owners]
    width = max(len(cell) for row in cells for cell in row)
    header = "     " + " ".join(f"{c:>{width}}" for c in range(cols))
    title = "ranks holding each element" + (" (each a summand)" if layout.has_partial() else "")
    return [title, header] + [f"{r:>3}  " + " ".join(f"{cell:>{width}}" for cell in row) for r, row in enumerate(cells)]


def _show_layout(name: str, layout: hs.Layout, max_cells: int) -> None:
    print(f"\nlayout {name}: {layout.sharding_string()}")
    print(f"  torch placements : {hs.to_placements(layout)}")
    print(f"  tensor_map       : {hs.to_tensor_map(layout)}   (mesh axes counted from the right)")
    block = _side_by_side(_rank_table(layout), _owner_grid(layout, max_cells))
    for line in block:
        print("  " + line)


def _show_plan(src_name: str, src: hs.Layout, dst_name: str, dst: hs.Layout, element_size: int) -> None:
    plan = hs.plan_redistribute(src, dst)
    print(f"\n{src_name} -> {dst_name}:  {src.sharding_string()}  ->  {dst.sharding_string()}")
    if not plan.steps:
        print("  (no steps: the layouts are equal)")
        return
    axis_names = src.mesh.axis_names
    for i, step in enumerate(plan.steps, 1):
        dims = []
        if step.src_dim >= 0:
            dims.append(f"from dim {step.src_dim}")
        if step.dst_dim >= 0:
            dims.append(f"to dim {step.dst_dim}")
        op = (
            f" ({hs.reduce_op_name(step.op)})"
            if step.kind in (hs.StepKind.AllReduce, hs.StepKind.ReduceScatter, hs.StepKind.PartialFill)
            else ""
        )
        sent = [n * element_size for n in step.elements_sent]
        what = f"{hs.step_kind_name(step.kind)}{op} along '{axis_names[step.axis]}'"
        print(f"  {i}. {what:<28} {', '.join(dims):<20} -> {step.to.sharding_string()}")
        print(f"     bytes sent per rank: {sent}")
    total = plan.total_elements() * element_size
    print(f"  total: {total} bytes")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hypershard.tools.layout_demo",
        description="Show hypershard's layout core: shard geometry of a 2-D tensor on a 2-D "
        "(dp, tp) mesh, the three layout notations, and redistribution plans.",
    )
    parser.add_argument(
        "--shape",
        default="6,5",
        type=lambda s: _parse_ints(s, ","),
        help="global tensor shape ROWS,COLS (default: 6,5, uneven on purpose)",
    )
    parser.add_argument(
        "--mesh", default="2x2", type=lambda s: _parse_ints(s, "x"), help="mesh shape DPxTP (default: 2x2)"
    )
    parser.add_argument(
        "--element-size", default=4, type=int, help="bytes per element for the plans (default: 4, float32)"
    )
    parser.add_argument(
        "--max-grid", default=16, type=int, help="largest dim for which the ownership grid is drawn (default: 16)"
    )
    args = parser.parse_args(argv)

    try:
        mesh = hs.mesh({"dp": args.mesh[0], "tp": args.mesh[1]})
        layouts = {name: hs.from_alias(mesh, args.shape, dims, partial) for name, dims, partial in _LAYOUTS}
    except hs.LayoutError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    print(_RULE)
    print(f"hypershard {hs.__version__} demo: the layout core")
    print(f"mesh {mesh}, ranks {mesh.ranks} (row-major); global tensor {args.shape}")
    print("Each dim is chunked torch.chunk-style over its mesh axes, major -> minor.")
    print(_RULE)
    for name, layout in layouts.items():
        _show_layout(name, layout, args.max_grid)

    print("\n" + _RULE)
    print(f"redistribution plans ({args.element_size} bytes per element)")
    print(_RULE)
    for src, dst in _PLANS:
        _show_plan(src, layouts[src], dst, layouts[dst], args.element_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
