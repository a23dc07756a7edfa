"""The DTensor core (as torch.distributed.tensor): the DTensor and its mesh, placements and
layouts (``_C``'s layout core with Python conveniences), the strict and debug modes, the traced
form a compiled program sees (TracedDTensor), user rules and local_map, the mesh-axis names, and
the fused ops. Reads only hypershard._C; every other floor builds on it."""
