"""Kept so that `import turboquant_hf.recipes` keeps working: this name is bound to the module
`turboquant_hf.quantization.recipes` itself."""

import sys

from .quantization import recipes

sys.modules[__name__] = recipes
