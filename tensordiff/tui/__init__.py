"""The Textual TUI (``tensordiff tui``), by job: ``app`` (the app, the command's entry
``run_tui`` and ``save_screenshot``), ``diff_thread`` (the diff in a thread, its progress
messages), ``widgets`` (widgets and screens), ``text`` (the panes' text) and ``data`` (the data
layer). Only ``app``, ``diff_thread`` and ``widgets`` import textual; this module imports none of
them, so ``tensordiff.tui.data`` and ``tensordiff.tui.text`` load without textual.
"""
