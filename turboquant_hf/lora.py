"""Kept so that `import turboquant_hf.lora` keeps working: this name is bound to the module
`turboquant_hf.integration.lora` itself."""

import sys

from .integration import lora

sys.modules[__name__] = lora
