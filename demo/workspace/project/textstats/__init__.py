"""Small text statistics: the demo task's project. Its median is wrong for
lists of even length, and one test says so."""

from .stats import mean, median, word_count, top_words

__all__ = ["mean", "median", "word_count", "top_words"]
