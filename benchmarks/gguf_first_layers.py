"""Copy a GGUF file keeping its first N layers: a real model's real blocks, small enough to carry
where the whole file does not fit (SmolLM2's 98 MB to a machine that takes 64 MiB at a time).

    python benchmarks/gguf_first_layers.py IN.gguf OUT.gguf N

Metadata is copied with ``{arch}.block_count`` set to N; tensors ``blk.I.*`` with I >= N are left
out, the others copied as stored. For checks that need the file's types and shapes, not its
answers (a model of fewer layers says other things).
"""

from __future__ import annotations

import sys

import gguf


def first_layers(src: str, dst: str, n: int) -> int:
    """Write ``src``'s first ``n`` layers to ``dst``; the bytes of tensors written."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = n if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return sum(int(t.n_bytes) for t in kept)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    written = first_layers(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(f"{sys.argv[2]}: {written / 1e6:.1f} MB of tensors")
