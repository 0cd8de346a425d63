"""Draft-and-verify decoding: the loop that asks a drafter for candidates, verifies them on a backend and keeps
what the acceptance rule accepts."""
