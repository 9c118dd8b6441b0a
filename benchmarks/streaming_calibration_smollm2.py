"""SmolLM2-135M, 3-bit, SAMPLES x 512 tokens of the calibration plays: the streaming converter (one block resident)
and from_pretrained + save_pretrained (float32), timed (wall and CPU seconds), their tensors compared, and the most
weights the streaming pass held.

    python benchmarks/streaming_calibration_smollm2.py THREADS SAMPLES OUT_DIR
"""
import json
import os
import shutil
import sys
import time

import torch

threads = int(sys.argv[1]); samples = int(sys.argv[2]); out = sys.argv[3]
torch.set_num_threads(threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_assets import smollm2_base
from quality import calibration_file
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig
from turboquant_hf.conversion.streaming import StreamingQuantizer
from turboquant_hf.quantization.config import CalibrationConfig

d = smollm2_base()
shutil.rmtree(out, ignore_errors=True); os.makedirs(out)
def cfg():
    return TurboQuantConfig(bits=3, calibration=CalibrationConfig(data=calibration_file(), samples=samples,
                                                                  sequence_length=512))
t = time.perf_counter(); c = time.process_time()
s = StreamingQuantizer.from_pretrained(d).quantize(out + "/stream", quantization_config=cfg(), dtype=torch.float32,
                                                    progress=False)
stream_s = time.perf_counter() - t; stream_cpu = time.process_time() - c
t = time.perf_counter(); c = time.process_time()
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=cfg())
m.save_pretrained(out + "/whole")
whole_s = time.perf_counter() - t; whole_cpu = time.process_time() - c
a = load_file(out + "/stream/model.safetensors"); b = load_file(out + "/whole/model.safetensors")
same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
full = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).parameters())
print(json.dumps({"threads": threads, "samples": samples, "streaming_s": round(stream_s, 1),
                  "from_pretrained_s": round(whole_s, 1),
                  "streaming_cpu_s": round(stream_cpu, 1), "from_pretrained_cpu_s": round(whole_cpu, 1), "same_tensors": same, "tensors": len(a),
                  "peak_resident_weights": s.peak_resident_weights, "model_float32_bytes": full,
                  "peak_rss": s.peak_rss, "peak_rss_before": s.peak_rss_before}), flush=True)
