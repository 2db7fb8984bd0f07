# A diamond: diamond-base <- diamond-left, diamond-right <- diamond-top. /bin/sh builders only; each
# output holds its name and its inputs' lines, so diamond-top's output shows both paths to the base.
{
  description = "Gradient example: a diamond of four derivations";

  outputs = { self }:
    let
      system = "x86_64-linux";
      salt = if builtins.pathExists ./salt then builtins.readFile ./salt else "";
      step = name: inputs: builtins.derivation {
        inherit name system salt inputs;
        builder = "/bin/sh";
        args = [ "-c" ''
          echo "${name}" > $out
          for input in $inputs; do
            while read -r line; do echo "  $line" >> $out; done < $input
          done
        '' ];
      };
      base = step "diamond-base" [ ];
      left = step "diamond-left" [ base ];
      right = step "diamond-right" [ base ];
      top = step "diamond-top" [ left right ];
    in
    {
      packages.${system} = { diamond-top = top; default = top; };
    };
}
