"""Small pieces every layer uses: timeouts, the job's secret, and import hooks."""
