"""The collapse guard and the signals it reads."""
