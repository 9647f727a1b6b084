"""Tools around the head: ``bench`` (measure), ``plan`` (predict memory), ``demo`` (a smoke run)."""
