"""Every loss that stands alone, registered: importing this module registers them all.

That is every registered loss but ``dcdl`` (discrepancy.py), which adds its class-discrepancy term to one of these,
its local loss: it imports this module to build that one by name, and ``catalog`` imports both. So neither imports
the other, and importing one loss module still registers nothing else.
"""

from __future__ import annotations

from retrieval.losses import ntxent, pair, proxy  # noqa: F401
