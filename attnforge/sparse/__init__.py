"""Query-aware sparse decode (Quest)."""
from .quest import QuestDecode, QuestIndex, page_scores, select_pages  # noqa: F401
