"""Query-aware sparse decode (Quest)."""
from .quest import QuestDecode, QuestIndex, channel_scales, page_scores, select_pages  # noqa: F401
from .quest_heads import QuestHeadDecode, expand_per_head  # noqa: F401
