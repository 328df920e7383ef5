"""scenes: example scenes, each a builder exposing ``scene`` and how it is tested."""
