"""SAVE's proof: rebuild from the serialized form, replay, compare bitwise."""
