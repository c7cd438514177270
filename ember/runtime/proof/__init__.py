"""SAVE's proof: rebuild from the serialized form, replay, compare bitwise (`prove`), its
torch-free arithmetic (`measures`), and the replay measurements every process shares (`replay`)."""
