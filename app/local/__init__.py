"""The local harness: a private Redis and Vigil's processes on one machine, the demo, and the tiny models built on the spot."""
