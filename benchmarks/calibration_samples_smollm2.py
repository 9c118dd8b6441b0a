"""Held-out KL and time of calibrated 3-bit SmolLM2-135M against the number of calibration sequences of 512 tokens.

    python benchmarks/calibration_samples_smollm2.py THREADS SAMPLES[,SAMPLES...]   (0: round-to-nearest)

Calibrated on the calibration plays (never Hamlet or Macbeth), evaluated on 4096 tokens of Hamlet + Macbeth: one JSON
line per count (seconds of `calibrate_model`, mean KL to the float32 model).
"""
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
threads = int(sys.argv[1]); samples = [int(x) for x in sys.argv[2].split(",")]
torch.set_num_threads(threads)
from offline_assets import EVALUATION_PLAYS, shakespeare_text, smollm2_base
from quality import calibration_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from turboquant_hf import TurboQuantConfig
from turboquant_hf.calibration.data import calibration_batches
from turboquant_hf.calibration.sequential import calibrate_model, rtn_quantize
from turboquant_hf.quantization import planning
from turboquant_hf.quantization.config import CalibrationConfig
from turboquant_hf.reporting.evaluation import compare_on_text, tokenize_text

d = smollm2_base()
base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(); tok = AutoTokenizer.from_pretrained(d)
ids = tokenize_text(tok, shakespeare_text(EVALUATION_PLAYS), 4096)
evaluate = True
if evaluate and 0 in samples:
    m = copy.deepcopy(base); rtn_quantize(m, planning.from_config(m, TurboQuantConfig(bits=3)))
    print(json.dumps({"samples": 0, "kl": compare_on_text(base, m, ids).mean_kl}), flush=True)
for s in [x for x in samples if x]:
    cal = CalibrationConfig(data=calibration_file(), samples=s, sequence_length=512)
    cfg = TurboQuantConfig(bits=3, calibration=cal)
    b = calibration_batches(cal, base, tok)
    m = copy.deepcopy(base)
    t = time.perf_counter(); calibrate_model(m, cfg, b); sec = time.perf_counter() - t
    kl = compare_on_text(base, m, ids).mean_kl if evaluate else None
    print(json.dumps({"samples": s, "threads": threads, "seconds": round(sec, 1), "kl": kl}), flush=True)
    del m
