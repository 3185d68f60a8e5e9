import collections
import re

_WORD = re.compile(r"[A-Za-z']+")


def word_count(text):
    """Number of words in text."""
    return len(_WORD.findall(text))


def top_words(text, n=3):
    """The n most common words, lower-cased, most common first; ties by word."""
    counts = collections.Counter(w.lower() for w in _WORD.findall(text))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def mean(values):
    """Arithmetic mean; ValueError on an empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    """Middle value; the mean of the two middle values for an even count."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid]
