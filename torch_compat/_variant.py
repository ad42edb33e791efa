"""Old home of the variant types and their detection, kept so that
``torch_compat._variant.*`` keeps working; nothing inside the project imports it.

The types, sqrt tables and cache are `torch_compat.variant`, the detection is
`torch_compat.calibrate` (called through `torch_compat.replay.detect_variant` etc.),
`variant_record` is `torch_compat.variant_cache`.
"""
from torch_compat.replay import (detect_foreach_variant, detect_fused_variant,  # noqa: F401
                                 detect_implementation_variant, detect_variant)
from torch_compat.variant import *  # noqa: F401,F403
from torch_compat.variant_cache import variant_record  # noqa: F401
