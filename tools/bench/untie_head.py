"""Writes a copy of a GGUF model whose output head is a separate tensor (`output.weight`, equal
to `token_embd.weight`) instead of tied to the embedding: the same network in the layout of
models with a separate head (Llama 3, Qwen2.5-1.5B+), so the embeddings-on-flash benchmark can
run on the default model. Usage: python3 untie_head.py IN.gguf OUT.gguf (needs PyPI gguf)."""
import sys

import gguf


def main(src, dst):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8", errors="surrogateescape"), vtype)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    names = [t.name for t in r.tensors]
    if "output.weight" in names:
        sys.exit("the head is already separate")
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    w.add_tensor("output.weight", emb.data, raw_dtype=emb.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
