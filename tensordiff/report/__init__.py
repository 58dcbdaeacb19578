"""The reports, by format: ``text`` (the rich text report, ``info``, the JSON schema's loader),
``html`` (the self-contained HTML report) and ``acceptance`` (the acceptance section both use).
"""
