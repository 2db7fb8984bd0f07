# The same two derivations for x86_64-linux and aarch64-linux: `tool` and `app` (which needs `tool`).
# Evaluate with the wildcard `packages.*.*`. The builders are /bin/sh, so a worker whose Nix lists
# aarch64-linux in extra-platforms builds the aarch64 ones on an x86_64 host (a stand-in for a real
# aarch64 machine).
{
  description = "Gradient example: derivations for two systems";

  outputs = { self }:
    let
      salt = if builtins.pathExists ./salt then builtins.readFile ./salt else "";
      forSystem = system:
        let
          step = name: inputs: builtins.derivation {
            inherit system salt inputs;
            name = "${name}-${system}";
            builder = "/bin/sh";
            args = [ "-c" ''
              echo "${name} for ${system}" > $out
              for input in $inputs; do
                while read -r line; do echo "  $line" >> $out; done < $input
              done
            '' ];
          };
          tool = step "tool" [ ];
        in
        { inherit tool; app = step "app" [ tool ]; };
    in
    {
      packages.x86_64-linux = forSystem "x86_64-linux";
      packages.aarch64-linux = forSystem "aarch64-linux";
    };
}
