"""Kept so that `import turboquant_hf.checkpoint` keeps working: this name is bound to the module
`turboquant_hf.format.checkpoint` itself."""

import sys

from .format import checkpoint

sys.modules[__name__] = checkpoint
