"""SGLang generators: the HTTP server per replica (launch, attach, restart), the engine adapter that drives it,
and the checks of the `--sglang-<flag>` server flags."""
