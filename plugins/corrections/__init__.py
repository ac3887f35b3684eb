"""Built-in off-policy corrections (entry-point group `hfllamarl.corrections`); the contract is
`hfllamarl.contracts.OffPolicyCorrection`, the building blocks `hfllamarl.corrections`."""
