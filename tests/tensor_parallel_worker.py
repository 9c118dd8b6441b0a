"""One rank of the tensor parallel tests (`tests/test_tensor_parallel.py` runs two of them with torchrun, gloo).

`python -m torch.distributed.run --nproc-per-node 2 tensor_parallel_worker.py OUT CASE...`, each CASE
`name=directory[:bits]`: the model in `directory` loads with `tp_plan="auto"` (quantized on the fly at `bits` when
given, `c<bits>` with calibration, else pre-quantized); rank r writes `OUT/name.r.pt` with its logits on fixed
tokens, a greedy continuation, its resident packed bytes and state-dict bytes, or the error the load raised."""

import os
import sys

import torch

torch.set_num_threads(1)


def main(out: str, cases: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    import turboquant_hf

    rank = int(os.environ["RANK"])
    tp = turboquant_hf.tensor_parallel
    arrived = []  # for each full-precision tensor quantized on the fly: whether the loader read only this rank's slice
    local_source = tp.local_source

    def recording_local_source(target, value):
        arrived.append(tp.is_local_slice(target, value))
        return local_source(target, value)

    tp.local_source = recording_local_source
    ids = torch.arange(3, 35).reshape(2, 16) % 200 + 3
    for case in cases:
        name, _, spec = case.partition("=")
        directory, _, bits = spec.partition(":")
        kw = {}
        if bits:  # `c3`: 3 bits with (data-free) calibration
            calibration = {"data": "data-free", "samples": 2, "sequence_length": 16} if bits[0] == "c" else None
            kw["quantization_config"] = turboquant_hf.TurboQuantConfig(bits=int(bits.lstrip("c")), group_size=64,
                                                                       calibration=calibration)
        record = {}
        arrived.clear()
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32, **kw)
        except ValueError as e:
            record["error"] = f"{type(e).__name__}: {e}"
        else:
            with torch.no_grad():
                record["logits"] = model(ids).logits
                record["generated"] = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
            record["packed_bytes"] = turboquant_hf.tensor_parallel.resident_packed_bytes(model)
            record["state_bytes"] = state_bytes(model)
            record["read_as_slices"] = (sum(arrived), len(arrived))
        torch.save(record, os.path.join(out, f"{name}.{rank}.pt"))


def state_bytes(model) -> int:
    """Bytes of this rank's part of every tensor of the state dict (its local shard of a DTensor)."""
    total = 0
    for t in model.state_dict().values():
        t = getattr(t, "_local_tensor", t)
        total += t.numel() * t.element_size()
    return total


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
