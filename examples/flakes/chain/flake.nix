# A chain: chain-a <- chain-b <- chain-c. Each builder is /bin/sh (no nixpkgs): it writes its name and
# then the lines of its input's output, so chain-c's output lists the whole chain.
{
  description = "Gradient example: a chain of three derivations";

  outputs = { self }:
    let
      system = "x86_64-linux";
      # An optional `salt` file changes every derivation (tests use it to get fresh builds).
      salt = if builtins.pathExists ./salt then builtins.readFile ./salt else "";
      step = name: inputs: builtins.derivation {
        inherit name system salt inputs;
        builder = "/bin/sh";
        args = [ "-c" ''
          echo "${name}" > $out
          for input in $inputs; do
            while read -r line; do echo "$line" >> $out; done < $input
          done
        '' ];
      };
      chain-a = step "chain-a" [ ];
      chain-b = step "chain-b" [ chain-a ];
      chain-c = step "chain-c" [ chain-b ];
    in
    {
      packages.${system} = { inherit chain-c; default = chain-c; };
    };
}
