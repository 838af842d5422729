"""Generated from protos/ by protos/gen_python.py. Do not edit."""
