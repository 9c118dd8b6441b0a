"""One rank of the tensor parallel tests (`tests/test_tensor_parallel.py` runs two of them with torchrun, gloo).

`python -m torch.distributed.run --nproc-per-node 2 tensor_parallel_worker.py OUT CASE...`, each CASE
`name=directory[:bits]`: the model in `directory` loads with `tp_plan="auto"` (names starting `ep_`: with the
experts split by expert, `expert_parallel_config`), quantized on the fly at `bits` when given (`c<bits>`: with
calibration), else pre-quantized; rank r writes `OUT/name.r.pt` with its logits on fixed
tokens, a greedy continuation, its resident packed bytes and state-dict bytes, or the error the load raised."""

import os
import sys

import torch

torch.set_num_threads(1)


def main(out: str, cases: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    import turboquant_hf

    rank = int(os.environ["RANK"])
    tp = turboquant_hf.integration.tensor_parallel
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
        if name.startswith("ep_"):  # expert parallelism over the same two ranks
            kw["distributed_config"] = expert_parallel_config()
        else:
            kw["tp_plan"] = "auto"
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kw)
        except ValueError as e:
            record["error"] = f"{type(e).__name__}: {e}"
        else:
            with torch.no_grad():
                record["logits"] = model(ids).logits
                record["generated"] = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
                if name.startswith("llama"):  # a static cache is sized by the KV heads of one rank
                    record["generated_static"] = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False,
                                                                cache_implementation="static")
            record["packed_bytes"] = turboquant_hf.integration.tensor_parallel.resident_packed_bytes(model)
            record["state_bytes"] = tp.local_state_bytes(model)
            record["read_as_slices"] = (sum(arrived), len(arrived))
            record["experts"] = [m.__dict__["tp_experts"] for m in model.modules() if "tp_experts" in m.__dict__]
            record["expert_bytes"] = expert_bytes(model)
            try:
                model.save_pretrained(os.path.join(out, f"saved_{name}_{rank}"))
            except ValueError as e:
                record["save_error"] = str(e)
        torch.save(record, os.path.join(out, f"{name}.{rank}.pt"))


def expert_parallel_config():
    """Tensor parallel size 2 with the experts split by expert: `ep_size=2` (transformers 5.21 and later) or
    `enable_expert_parallel=True` (before)."""
    import inspect

    from transformers.distributed import DistributedConfig

    if "ep_size" in inspect.signature(DistributedConfig).parameters:
        return DistributedConfig(tp_size=2, ep_size=2)
    return DistributedConfig(tp_size=2, enable_expert_parallel=True)


def expert_bytes(model) -> int:
    """Packed bytes of the fused experts this rank holds."""
    from turboquant_hf.integration.tensor_parallel import resident_packed_bytes
    from turboquant_hf.modeling.modules import TurboQuantExperts

    return sum(resident_packed_bytes(m) for m in model.modules() if isinstance(m, TurboQuantExperts))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
