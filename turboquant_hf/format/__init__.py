"""The tq3_native format and everything that reads or writes it without a model: the format's constants
(`constants`), the codec in plain torch (`codec`), the GPU runtime layout of packed indices (`runtime_layout`), the
whole-row Hadamard rotation of the MLX family (`hadamard`), checkpoint headers on disk (`checkpoint`) and
safetensors shards read and written in slices (`shards`).

`turboquant_hf.format` itself gives the names of `constants` (`turboquant_hf.format.codebook(...)`), as the module
of that name did.
"""

from .constants import *
