"""The Redis / Redis Cluster tier (``{"type": "redis", ...}`` in ``secondary_tiers``).

See ``docs/redis-tier.md`` for the settings, the stored format and the fault
behaviour.
"""

from tiers.redis.config import RedisTierConfig
from tiers.redis.errors import RedisTierCommandError, RedisTierTimeout, RedisTierUnavailable
from tiers.redis.layout import FORMAT_VERSION, HEADER_LEN, BlockLayout
from tiers.redis.stats import RedisTierStats
from tiers.redis.tier import RedisTier

__all__ = [
    "FORMAT_VERSION",
    "HEADER_LEN",
    "BlockLayout",
    "RedisTier",
    "RedisTierCommandError",
    "RedisTierConfig",
    "RedisTierStats",
    "RedisTierTimeout",
    "RedisTierUnavailable",
]
