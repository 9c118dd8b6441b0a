"""Kept so that `import turboquant_hf.codec` keeps working: this name is bound to the module
`turboquant_hf.format.codec` itself."""

import sys

from .format import codec

sys.modules[__name__] = codec
