"""Kept so that `import turboquant_hf.config` keeps working: this name is bound to the module
`turboquant_hf.quantization.config` itself."""

import sys

from .quantization import config

sys.modules[__name__] = config
