"""What the tiered-pool properties draw from (tests/core/test_tiers.py and the
answer bounds of tests/allocator/test_hostile_input.py)."""

# What becomes of a save in flight, at each step: most land, some fail, some wait.
FATES = ["land", "land", "land", "fail", "wait", "wait"]
# Conversations' tokens over a two-token vocabulary: prompts cut from them share prefixes often.
CONVERSATIONS = [
    [0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1],
    [1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 0],
    [0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0],
]
