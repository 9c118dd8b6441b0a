"""Kept so that `import turboquant_hf.streaming` keeps working: this name is bound to the module
`turboquant_hf.conversion.streaming` itself."""

import sys

from .conversion import streaming

sys.modules[__name__] = streaming
