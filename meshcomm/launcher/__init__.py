"""The launchers' machinery: ``meshrun``'s command line, supervision, output, and exits."""
