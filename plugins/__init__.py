"""Built-in plugins of hfllamarl: rewards, algorithms and weight-sync backends.

They register through the same entry points (`setup.py`) as third-party plugins.
"""
