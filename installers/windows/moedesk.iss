; Inno Setup 6 script: MoE Desk's setup.exe, a per-user installer (no administrator rights) around install.ps1.
; Build on Windows from this folder:  "C:\Program Files (x86)\Inno Setup 6\ISCC.exe" moedesk.iss
; Output: Output\MoEDesk-<version>-setup.exe. See README.md beside this file (what it bundles, how to build).
;
; setup.exe copies the app's source, the PowerShell scripts and (when vendor\ holds them) an embeddable Python and
; pip's wheel into {app}, then runs install.ps1, which builds the private Python environment, downloads PyTorch
; (CUDA or CPU build, chosen on the user's machine) and makes the shortcuts. Uninstalling runs uninstall.ps1.

#define AppName "MoE Desk"
#define AppVersion "0.1.0"
#define Root "..\.."

[Setup]
AppId={{6B0F6C59-3F0B-4B8E-9A51-7C1E2D5A9E42}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=MoE Desk
DefaultDirName={autopf}\{#AppName}
DisableDirPage=yes
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
OutputBaseFilename=MoEDesk-{#AppVersion}-setup
SetupIconFile={#Root}\resources\icons\moedesk.ico
UninstallDisplayIcon={app}\moedesk.ico
UninstallDisplayName={#AppName}
Compression=lzma2
SolidCompression=yes
WizardStyle=modern
CloseApplications=yes

[Tasks]
Name: "desktopicon"; Description: "Create a desktop shortcut"; GroupDescription: "Shortcuts:"
Name: "cpuonly"; Description: "Install the CPU build of PyTorch even if an NVIDIA GPU is found (smaller download)"; GroupDescription: "PyTorch:"; Flags: unchecked

[Files]
Source: "{#Root}\pyproject.toml"; DestDir: "{app}\src"; Flags: ignoreversion
Source: "{#Root}\README.md"; DestDir: "{app}\src"; Flags: ignoreversion
Source: "{#Root}\app\*"; DestDir: "{app}\src\app"; Excludes: "__pycache__,*.pyc"; Flags: ignoreversion recursesubdirs
Source: "{#Root}\engine\*"; DestDir: "{app}\src\engine"; Excludes: "__pycache__,*.pyc"; Flags: ignoreversion recursesubdirs
Source: "{#Root}\resources\*"; DestDir: "{app}\src\resources"; Flags: ignoreversion recursesubdirs
Source: "install.ps1"; DestDir: "{app}"; Flags: ignoreversion
Source: "uninstall.ps1"; DestDir: "{app}"; Flags: ignoreversion
Source: "wsl-shortcut.ps1"; DestDir: "{app}"; Flags: ignoreversion
; optional, see README.md: an embeddable Python for machines without one, and pip's wheel for it
Source: "vendor\python-embed-amd64.zip"; DestDir: "{app}\vendor"; Flags: ignoreversion skipifsourcedoesntexist
Source: "vendor\pip-*.whl"; DestDir: "{app}\vendor"; Flags: ignoreversion skipifsourcedoesntexist

[UninstallRun]
Filename: "{sys}\WindowsPowerShell\v1.0\powershell.exe"; Parameters: "-NoProfile -ExecutionPolicy Bypass -File ""{app}\uninstall.ps1"" -InstallDir ""{app}"" -KeepSetupFiles"; Flags: runhidden waituntilterminated; RunOnceId: "MoEDeskUninstall"

[UninstallDelete]
Type: filesandordirs; Name: "{app}\venv"
Type: filesandordirs; Name: "{app}\python"
Type: files; Name: "{app}\moedesk.ico"
Type: files; Name: "{app}\installed-files.txt"
Type: files; Name: "{app}\install.log"
Type: files; Name: "{app}\.moedesk-install"
Type: dirifempty; Name: "{app}"

[Run]
Filename: "{userprograms}\{#AppName}.lnk"; Description: "Start {#AppName}"; Flags: shellexec postinstall nowait skipifsilent skipifdoesntexist

[Code]
// install.ps1 runs after the files are copied, in a console window so its progress (pip's downloads) shows;
// a failure is reported with the log's path instead of passing silently.
procedure CurStepChanged(CurStep: TSetupStep);
var
  Params: String;
  ResultCode: Integer;
begin
  if CurStep <> ssPostInstall then
    Exit;
  Params := '-NoProfile -ExecutionPolicy Bypass -File "' + ExpandConstant('{app}\install.ps1') + '"' +
            ' -Source "' + ExpandConstant('{app}\src') + '"' +
            ' -InstallDir "' + ExpandConstant('{app}') + '"';
  if FileExists(ExpandConstant('{app}\vendor\python-embed-amd64.zip')) then
    Params := Params + ' -PythonZip "' + ExpandConstant('{app}\vendor\python-embed-amd64.zip') + '"'
  else
    Params := Params + ' -AllowPythonDownload';
  if not WizardIsTaskSelected('desktopicon') then
    Params := Params + ' -NoDesktopShortcut';
  if WizardIsTaskSelected('cpuonly') then
    Params := Params + ' -Cpu';
  WizardForm.StatusLabel.Caption := 'Installing Python, PyTorch and MoE Desk (the CUDA build of PyTorch is a few GB)...';
  if not Exec(ExpandConstant('{sys}\WindowsPowerShell\v1.0\powershell.exe'), Params, '', SW_SHOWNORMAL,
              ewWaitUntilTerminated, ResultCode) or (ResultCode <> 0) then
    MsgBox('MoE Desk could not be set up completely (exit code ' + IntToStr(ResultCode) + ').' + #13#10 +
           'The log is ' + ExpandConstant('{app}\install.log') + '. Running setup again retries and keeps what was done.',
           mbError, MB_OK);
end;
