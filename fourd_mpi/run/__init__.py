"""One run: the option table and its resolution (``options``), config files, building the live
run on a communicator, the traced session, verification, metadata and console display.
"""
