"""Kept so that `import turboquant_hf.quantizer` keeps working: this name is bound to the module
`turboquant_hf.integration.quantizer` itself."""

import sys

from .integration import quantizer

sys.modules[__name__] = quantizer
