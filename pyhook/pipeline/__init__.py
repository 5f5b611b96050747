"""The capture pipeline, one module per stage (imports run one way, top to bottom).

This package is being assembled; see docs/contributing.md for the map.
"""
