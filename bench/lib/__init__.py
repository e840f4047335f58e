"""What every benchmark shares: ``report`` (the JSON writer, its header, the rich tables),
``environment`` (the machine and versions a result was measured on), ``stats`` (the one
percentile, and the load results' distribution summary) and ``plot`` (the one matplotlib
set-up)."""
