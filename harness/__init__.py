"""Throwaway processes for tests, compat tests and benchmarks: free ports, etcd, Postgres, nodes, clusters."""
