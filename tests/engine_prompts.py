"""Prompts shared by the engine tests: short chat turns, and one long enough that prefill spans many chunks."""

LONG_TEXT = (
    "Shared memory lets two processes on one machine exchange data without copying it through the kernel. "
    "A ring buffer in shared memory has a producer that writes records and a consumer that reads them; "
    "each side owns one index and only reads the other's. "
)

LONG_TOPICS = [
    "the history of the printing press", "how bees build hexagonal combs", "why rivers meander",
    "the rules of chess castling", "how vaccines train the immune system", "the life cycle of stars",
    "how compilers optimise loops", "the water cycle", "why bread rises", "how bridges carry loads",
    "the migration of monarch butterflies", "how tides follow the moon",
]


def long_user_message() -> str:
    """A user turn of about 700 tokens (with the chat template): a passage, then a request to summarise it."""
    parts = [LONG_TEXT]
    for i, topic in enumerate(LONG_TOPICS):
        parts.append(f"Note {i + 1}: a short paragraph about {topic} would explain the main idea, give one "
                     f"example, and end with a question a student might ask about {topic}. ")
    parts.append("Now summarise the notes above in three sentences.")
    return "".join(parts[:1] + parts[1:] + parts[1:4])
